"""One DiLoCo site of tests/distributed/test_diloco_sites.py: its own process and world.

``python -m tests.helpers.ft_site SITE_ID OUT_DIR`` (environment: ``TORCHFT_LIGHTHOUSE``,
``MASTER_PORT``) trains a small model with AdamW and
:class:`~megatron_ext.optim.diloco_ft.FaultTolerantDiLoCoHook` (H = 3, the DiLoCo paper's
outer optimizer) on data of its own (its site id seeds it), in a gloo world of one rank,
until an outer step in which ``FT_SITES`` sites contributed once the file ``OUT_DIR/stop``
exists. ``FT_FRAGMENTS``: streaming DiLoCo's fragments (default 1); ``FT_DELAY``: the
steps an exchange overlaps (``--outer-delay``, default 0). With a delay, site 0 keeps the
file ``OUT_DIR/inflight`` while its exchange is in flight, and once ``OUT_DIR/stop`` exists
it holds an exchange in flight until ``OUT_DIR/joining`` exists; a site started with
``FT_JOIN_IN_FLIGHT=1`` waits for ``inflight``, then writes ``joining`` (with the time) and
joins: its join starts while site 0's exchange is in flight. After every committed
outer step it saves, as ``<site>_<step>.pt``, its weights, its snapshots (the global
weights), the names of the fragment synchronized, what it sent (weighted pseudo-gradient and weight; with ``FT_COMPRESSION`` set to an
``--outer-compression`` method, its pseudo-gradient times ``w / sum(w)``, None when nothing
was exchanged) and the sum it received. ``FT_STALL_SITE``: that site stalls inside a
compressed exchange (see below) so that a test can kill it mid-exchange.
"""

import os
import sys
import time

import torch


def main() -> int:
    site, out = int(sys.argv[1]), sys.argv[2]
    want_sites = int(os.environ.get("FT_SITES", "3"))
    stop = os.path.join(out, "stop")
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=0, world_size=1
    )
    from megatron_ext.optim.diloco_ft import FaultTolerantDiLoCoHook
    from tests.helpers.views import ParamsView

    torch.manual_seed(11)  # the same start on every site
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    params = dict(model.named_parameters())
    inner = torch.optim.AdamW(model.parameters(), lr=0.02)
    clock = {"step": 0}

    from megatron_ext.options.outer import OuterConfig

    opts = OuterConfig(
        interval=3,
        fragments=int(os.environ.get("FT_FRAGMENTS", "1")),
        delay=int(os.environ.get("FT_DELAY", "0")),
        compression=os.environ.get("FT_COMPRESSION", "none"),
        transport="torchft",
        site_id=site,
        sites=3,
        min_sites=int(os.environ.get("FT_MIN_SITES", "2")),
        quorum_timeout=120.0,
        timeout=20.0,
    )
    hook = FaultTolerantDiLoCoHook(opts)
    view = ParamsView(params, clock)
    hook.setup(view)
    sent = {}
    transport = hook.transport
    plain = transport.sum_and_commit

    def recorded(buf):
        sent["buf"] = buf.clone()
        ok = plain(buf)
        sent["sum"] = buf.clone()
        return ok

    transport.sum_and_commit = recorded
    # the overlapped dense exchange: what was sent at its start, the sum at the commit vote
    plain_start, plain_commit = transport.start_sum, transport.commit

    def start_recorded(buf):
        sent["buf"], sent["flight"] = buf.clone(), buf
        return plain_start(buf)

    def commit_recorded():
        if "flight" in sent:
            sent["sum"] = sent.pop("flight").clone()
        return plain_commit()

    transport.start_sum, transport.commit = start_recorded, commit_recorded
    armed = []  # a commit of three contributing sites has been recorded
    if os.environ.get("FT_STALL_SITE") == str(site):
        # Stall inside the first compressed exchange of three sites after a committed
        # outer step that all three contributed to (the others are then inside its
        # collectives), leaving the file OUT_DIR/stalled: the test kills this site there.
        from megatron_ext.collectives.outer_exchange import OuterExchange

        plain_average = OuterExchange.average

        def stalled(self, flat, **kw):
            if self.size == 3 and armed:
                open(os.path.join(out, "stalled"), "w").close()
                time.sleep(3600)
            return plain_average(self, flat, **kw)

        OuterExchange.average = stalled
    seen = [0]

    def record() -> bool:
        """Save every new commit (right after it: the weights it left); True: done."""
        while seen[0] < len(hook.events):
            ev = hook.events[seen[0]]
            seen[0] += 1
            if ev["event"] != "commit":
                continue
            if hook.compressed:  # what the compressed exchange sent and received
                last = getattr(hook, "last_exchange", {})
                sent["buf"], sent["sum"] = last.get("sent"), last.get("received")
            torch.save(
                {
                    "weights": {n: p.detach().clone() for n, p in params.items()},
                    "snapshot": {n: t.clone() for n, t in hook.snapshot.items()},
                    "synced": list(hook.fragments[int(ev["fragment"])]),
                    "sent": sent.get("buf"),
                    "sum": sent.get("sum"),
                    "event": ev,
                },
                os.path.join(out, f"{site}_{ev['step']}.pt"),
            )
            if float(ev["total_weight"]) == 3:
                armed.append(ev["step"])
            if float(ev["total_weight"]) == want_sites and os.path.exists(stop):
                return True
        return False

    gen = torch.Generator().manual_seed(1000 + site)
    marker = os.path.join(out, "inflight")
    if os.environ.get("FT_JOIN_IN_FLIGHT") == "1":
        while not os.path.exists(marker):
            time.sleep(0.002)
        with open(os.path.join(out, "joining"), "w") as f:
            f.write(repr(time.time()))
    for step in range(100000):
        clock["step"] = step
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
        inner.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        hook.pre_step(view)  # the first one joins (an outer step with weight 0)
        record()
        inner.step()
        hook.post_step(view, True)
        if site == 0 and opts.delay:
            if hook._inflight is not None:
                open(marker, "w").close()
                if os.path.exists(stop):  # a site is about to rejoin: hold until it joins
                    while not os.path.exists(os.path.join(out, "joining")):
                        time.sleep(0.002)
            elif os.path.exists(marker):
                os.remove(marker)
        if record():
            hook.finish()
            print(f"site {site}: done at iteration {step}", flush=True)
            return 0
        time.sleep(0.02)  # a site's step takes time; the others' outer steps interleave
    return 1


if __name__ == "__main__":
    sys.exit(main())
