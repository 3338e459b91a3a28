"""DiLoCo's pure parts and refusals (no process group, no Megatron run).

The outer step against ``torch.optim.SGD`` (Nesterov and heavy-ball) and a float64
statement; fragments cover every parameter exactly once per cycle; the flags' refusals
name the flags, before training (options, layout, driver).
"""

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from megatron_ext.config import ConfigError, ParallelLayout, ext_config_from_flags
from megatron_ext.optim.diloco import (
    DenseOuterExchange,
    fragment_due,
    make_outer_exchange,
    outer_sgd_step,
    split_fragments,
)
from megatron_ext.protocols import OptimizerView


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_is_torch_sgd_and_float64_reference(nesterov):
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(50, generator=gen)
    deltas = [torch.randn(50, generator=gen) for _ in range(4)]
    lr, mu = 0.7, 0.9
    # torch.optim.SGD on a parameter whose gradient is the pseudo-gradient.
    p = torch.nn.Parameter(start.clone())
    sgd = torch.optim.SGD([p], lr=lr, momentum=mu, nesterov=nesterov)
    snap, buf = start.clone(), None
    ref, ref_buf = start.double(), None
    for d in deltas:
        p.grad = d.clone()
        sgd.step()
        buf = outer_sgd_step(snap, buf, d, lr=lr, momentum=mu, nesterov=nesterov)
        d64 = d.double()
        ref_buf = d64.clone() if ref_buf is None else mu * ref_buf + d64
        ref = ref - lr * (d64 + mu * ref_buf if nesterov else ref_buf)
    assert torch.equal(snap, p.detach())
    assert (snap.double() - ref).abs().max() < 1e-5
    # No momentum: plain SGD, no buffer kept.
    s = start.clone()
    assert outer_sgd_step(s, None, deltas[0], lr=1.0, momentum=0.0, nesterov=True) is None
    assert torch.equal(s, start - deltas[0])


@pytest.mark.parametrize("num_fragments,interval", [(1, 5), (2, 4), (3, 7), (4, 4)])
def test_fragments_cover_every_parameter_once_per_cycle(num_fragments, interval):
    sizes = [(f"p{i}", n) for i, n in enumerate([7, 300, 5, 64, 64, 1, 900, 33, 2])]
    frags = split_fragments(sizes, num_fragments)
    flat = [f for frag in frags for f in frag]
    assert flat == [f for f, _ in sizes]  # contiguous, in order, each once
    for cycle in range(3):
        due = [
            i
            for t in range(cycle * interval + 1, (cycle + 1) * interval + 1)
            for i in fragment_due(t, interval, num_fragments)
        ]
        assert sorted(due) == list(range(num_fragments))  # each fragment once per cycle
    assert fragment_due(interval, interval, num_fragments)[0] == 0


def test_dense_exchange_without_group_and_factory():
    ex = make_outer_exchange("none", None, 4, None, "cpu")
    assert isinstance(ex, DenseOuterExchange) and ex.wire_bytes() == 0
    x = torch.arange(4.0)
    assert torch.equal(ex.average(x), x)
    with pytest.raises(ValueError, match="4 fp32 elements"):
        ex.average(torch.zeros(3))
    with pytest.raises(ValueError, match="unknown outer exchange 'int4'"):
        make_outer_exchange("int4", None, 4, None, "cpu")


class _View(OptimizerView):
    """fp32 parameters that are their own main copies."""

    def __init__(self, params):
        from megatron_ext.protocols import ParamOptimState

        self.params = params
        self._step = 0
        self.states = {
            f: ParamOptimState(fqn=f, model_param=p, main_param=p, state={})
            for f, p in params.items()
        }

    @property
    def step(self):
        return self._step

    @step.setter
    def step(self, value):
        self._step = value

    def fqns(self):
        return sorted(self.params)

    def param_state(self, fqn):
        return self.states.get(fqn)

    def param_numels(self):
        return {f: p.numel() for f, p in self.params.items()}

    def write_param(self, fqn, value):
        self.params[fqn].copy_(value.view_as(self.params[fqn]))

    def sync_params(self):
        pass


def test_outer_state_starts_from_the_loaded_weights_unless_it_was_loaded():
    """Allocated at install from the initial weights; a load that writes the weights but not
    DiLoCo's state (--finetune, reset, an elastic resume's fresh state) must not leave the
    initial weights as the snapshot, or the first outer step pulls the model back to them."""
    from megatron_ext.elastic import remap_objects
    from megatron_ext.optim.diloco import DiLoCoHook
    from megatron_ext.options.outer import OuterConfig

    opts = OuterConfig(interval=2)  # the paper's outer optimizer: lr 0.7, Nesterov 0.9

    def run(load=None, elastic=False):
        params = {"w": torch.zeros(3), "b": torch.zeros(2)}  # the initial weights
        view = _View(params)
        hook = DiLoCoHook(opts, None)
        hook.setup(view)  # at install, before the checkpoint load
        fresh = hook.state_dict()
        for p in params.values():  # the checkpoint's weights
            p.fill_(5.0)
        if elastic:  # every role reset: the freshly built state goes back in
            objects, reset = remap_objects(
                [{"diloco": fresh}],
                {"diloco": fresh},
                {"diloco": fresh},
                {"diloco": DiLoCoHook.elastic_rules},
                old_dp=2,
                new_dp=1,
            )
            assert "diloco: anchored" in reset and "diloco: snapshot" in reset
            hook.load_state_dict(objects["diloco"])
        elif load is not None:
            hook.load_state_dict(load)
        assert not fresh["anchored"]
        for step in range(2):  # an inner step each, then the outer step after the second
            view.step = step
            hook.pre_step(view)
            for p in params.values():
                p.sub_(1.0)
            hook.post_step(view, True)
        return params, hook

    # Not loaded (--finetune, reset) and the elastic reset: the pseudo-gradient is 5 - 3 = 2
    # from the loaded weights; the first Nesterov step moves by lr * (1 + mu) * 2.
    expected = 5.0 - 0.7 * 1.9 * 2.0
    for params, hook in (run(), run(elastic=True)):
        assert hook.anchored and hook.syncs == 1
        assert all(torch.allclose(p, torch.full_like(p, expected)) for p in params.values())
    # A saved state after training steps is loaded as saved (snapshot 4: pseudo-gradient 2
    # from it, momentum continues from the saved buffer of 1).
    _, trained = run()
    saved = trained.state_dict()
    assert saved["anchored"]
    saved["snapshot"] = {f: torch.full_like(t, 4.0) for f, t in saved["snapshot"].items()}
    saved["momentum"] = {f: torch.full_like(t, 1.0) for f, t in saved["snapshot"].items()}
    params, hook = run(load=saved)
    buf = 0.9 * 1.0 + 1.0  # delta = 4 - 3
    assert all(
        torch.allclose(p, torch.full_like(p, 4.0 - 0.7 * (1.0 + 0.9 * buf)))
        for p in params.values()
    )
    # Saved at state format 1 before the flag existed: taken as a trained state once
    # upgraded (megatron_ext.state.ExtState.upgrade); a current-format state must have it.
    legacy = {k: v for k, v in saved.items() if k != "anchored"}
    with pytest.raises(ValueError, match="diloco state keys"):
        run(load=legacy)
    params, _ = run(load=DiLoCoHook(opts, None).upgrade_state(legacy, 1))
    assert all(
        torch.allclose(p, torch.full_like(p, 4.0 - 0.7 * (1.0 + 0.9 * buf)))
        for p in params.values()
    )


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--outer-interval", "0"], "--outer-interval"),
        (["--outer-lr", "0"], "--outer-lr"),
        (["--outer-momentum", "1"], "--outer-momentum"),
        (["--outer-groups", "0"], "--outer-groups"),
        (["--outer-fragments", "5", "--outer-interval", "4"], "--outer-fragments"),
        (["--outer-compression", "int4"], "--outer-compression"),
        (["--outer-delay", "-1"], "--outer-delay"),
        (["--outer-delay", "4", "--outer-interval", "4"], "--outer-delay"),
        (["--outer-merge-alpha", "1.5"], "--outer-merge-alpha"),
    ],
)
def test_option_refusals_name_the_flag(flags, named):
    with pytest.raises(ConfigError) as err:
        ext_config_from_flags(["--outer-method", "diloco"] + flags)
    assert named in err.value.flags


def test_layout_refusals():
    from megatron_ext.config import validate_ext_config

    cfg = ext_config_from_flags(["--outer-method", "diloco", "--outer-groups", "3"])
    with pytest.raises(ConfigError, match="--outer-groups: 3 sites do not divide .* 4"):
        validate_ext_config(cfg, ParallelLayout(data_parallel_size=4))
    cfg = ext_config_from_flags(["--outer-method", "diloco"])
    validate_ext_config(cfg, ParallelLayout(data_parallel_size=4))

    # The distributed optimizer inside a site: each site one optimizer instance.
    def dist_opt(instances):
        return ParallelLayout(
            data_parallel_size=4,
            use_distributed_optimizer=True,
            num_distributed_optimizer_instances=instances,
        )

    named = "--num-distributed-optimizer-instances, --outer-groups: .*instances 4 .got 1"
    with pytest.raises(ConfigError, match=named):
        validate_ext_config(cfg, dist_opt(1))
    validate_ext_config(cfg, dist_opt(4))
    two = ext_config_from_flags(["--outer-method", "diloco", "--outer-groups", "2"])
    with pytest.raises(ConfigError, match="instances 2 .got 4"):
        validate_ext_config(two, dist_opt(4))
    # Several instances are only ever DiLoCo's sites.
    plain = ext_config_from_flags(["--grad-compression", "powersgd"])
    with pytest.raises(ConfigError, match="^--num-distributed-optimizer-instances: .*DiLoCo"):
        validate_ext_config(plain, dist_opt(2))
    cfg = ext_config_from_flags(["--outer-method", "diloco", "--grad-compression", "powersgd"])
    with pytest.raises(ConfigError, match="--grad-compression, --outer-groups"):
        validate_ext_config(cfg, ParallelLayout(data_parallel_size=2))
    cfg = ext_config_from_flags(
        ["--outer-method", "diloco", "--outer-groups", "1", "--grad-compression", "powersgd"]
    )
    validate_ext_config(cfg, ParallelLayout(data_parallel_size=2))
    pp2 = ParallelLayout(data_parallel_size=2, pipeline_model_parallel_size=2)
    refused = [
        (
            ["--subspace-method", "protocol", "--subspace-update-interval", "10"],
            "--outer-method, --subspace-update-interval",
        ),
        (
            ["--subspace-method", "protocol", "--outer-compression", "quantized"],
            "--outer-compression, --subspace-method",
        ),
    ]
    for flags, named in refused:
        cfg = ext_config_from_flags(["--outer-method", "diloco"] + flags)
        with pytest.raises(ConfigError, match=named):
            validate_ext_config(cfg, pp2)
    # Protocol Models with a fixed subspace and the exact exchange: accepted.
    cfg = ext_config_from_flags(["--outer-method", "diloco", "--subspace-method", "protocol"])
    validate_ext_config(cfg, pp2)
    # Grass: accepted (the outer step moves its frozen weights, GrassOuterView); with the
    # distributed optimizer refused by Grass itself.
    cfg = ext_config_from_flags(["--outer-method", "diloco", "--grass-method", "topr"])
    validate_ext_config(cfg, pp2)
    cfg = ext_config_from_flags(
        ["--outer-method", "diloco", "--outer-groups", "4", "--grass-method", "topr"]
    )
    with pytest.raises(ConfigError, match="--grass-method, --use-distributed-optimizer"):
        validate_ext_config(cfg, dist_opt(4))


def test_driver_refuses_the_replica_hash_with_several_sites():
    from megatron_ext.config import validate_ext_config
    from megatron_ext.train import parse_args
    from megatron_ext.train_config import driver_layout, layout_sizes

    def check(flags):
        cfg = parse_args(["--cpu", "--outer-method", "diloco"] + flags)
        validate_ext_config(cfg.ext, driver_layout(cfg, layout_sizes(cfg, 2)))

    extra = ["--check-weight-hash-across-dp-replicas-interval", "5"]
    with pytest.raises(ConfigError, match="^--check-weight-hash-across-dp-replicas-interval, "):
        check(extra)
    check(["--outer-groups", "1"] + extra)  # one site (G = 1): megatron's replicas are identical
    check(["--save", "/tmp/x"])  # checkpoints with several sites are supported


def _lm_layout(**attrs):
    """``layout_from_args`` of Megatron-LM args with DP = 2 and ``attrs`` set."""
    from types import SimpleNamespace

    from megatron_ext.megatron.lm.arguments import layout_from_args

    args = dict(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        data_parallel_size=2,
        virtual_pipeline_model_parallel_size=None,
        use_distributed_optimizer=False,
        overlap_grad_reduce=False,
        num_distributed_optimizer_instances=1,
        transformer_impl="local",
        check_weight_hash_across_dp_replicas_interval=None,
        calculate_per_token_loss=False,
        dataloader_type="single",
    )
    return layout_from_args(SimpleNamespace(**{**args, **attrs}))


@pytest.mark.parametrize(
    "attrs,named",
    [
        ({"check_weight_hash_across_dp_replicas_interval": 5}, "--check-weight-hash"),
        ({"calculate_per_token_loss": True, "groups": 1}, "--calculate-per-token-loss"),
    ],
)
def test_megatron_lm_refusals(attrs, named):
    """The refusals of pretrain_gpt.py's arguments, from the run Megatron-LM's args describe
    (the same checks as the driver's)."""
    from megatron_ext.config import validate_ext_config

    groups = attrs.pop("groups", None)
    flags = ["--outer-method", "diloco"] + ([] if groups is None else ["--outer-groups", "1"])
    with pytest.raises(ConfigError, match=named):
        validate_ext_config(ext_config_from_flags(flags), _lm_layout(**attrs))
    if groups is None:  # one site: allowed
        cfg = ext_config_from_flags(flags + ["--outer-groups", "1"])
        validate_ext_config(cfg, _lm_layout(**attrs))


def test_megatron_lm_checkpoints_with_several_sites_are_accepted():
    from megatron_ext.config import validate_ext_config

    validate_ext_config(ext_config_from_flags(["--outer-method", "diloco"]), _lm_layout())


def test_torchft_transport_refusals_name_the_flags(monkeypatch):
    """--outer-transport torchft: what it cannot serve is refused before training, naming
    the flags; a complete set of flags is accepted (and one site per job: G = 1)."""
    from megatron_ext.config import validate_ext_config

    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    site = ["--outer-method", "diloco", "--outer-transport", "torchft"]
    ok = site + ["--outer-site-id", "1", "--outer-sites", "3", "--outer-min-sites", "2"]
    refused = [
        (site, "--outer-transport, --outer-site-id"),
        (site + ["--outer-site-id", "3", "--outer-sites", "3"], "--outer-sites, --outer-site-id"),
        (ok[:-1] + ["4"], "--outer-min-sites, --outer-sites"),
        (ok + ["--outer-groups", "2"], "--outer-transport, --outer-groups"),
        (
            ok + ["--outer-interval", "4", "--outer-fragments", "2", "--outer-delay", "2"],
            "--outer-transport, --outer-delay, --outer-fragments",
        ),
        (ok + ["--outer-quorum-timeout", "0"], "--outer-quorum-timeout"),
    ]
    for flags, named in refused:
        with pytest.raises(ConfigError) as err:
            ext_config_from_flags(flags)
        assert ", ".join(err.value.flags) == named, (flags, str(err.value))
    cfg = ext_config_from_flags(ok)
    for method in ("quantized", "radius", "separate", "powersgd"):  # served since torchft
        ext_config_from_flags(ok + ["--outer-compression", method])
    streaming = ok + ["--outer-fragments", "2", "--outer-interval", "4"]
    ext_config_from_flags(streaming + ["--outer-delay", "1", "--outer-merge-alpha", "0.5"])
    ext_config_from_flags(ok + ["--outer-interval", "4", "--outer-delay", "3"])  # one fragment
    layout = ParallelLayout(data_parallel_size=2)
    with pytest.raises(ConfigError, match="^--outer-transport, --outer-lighthouse: "):
        validate_ext_config(cfg, layout)
    cfg = ext_config_from_flags(ok + ["--outer-lighthouse", "http://127.0.0.1:29510"])
    from megatron_ext.options.outer import OuterConfig
    from megatron_ext.train import parse_args
    from megatron_ext.train_config import driver_layout, layout_sizes

    torchft = importlib.util.find_spec("torchft") is not None
    if torchft:
        validate_ext_config(cfg, _lm_layout())  # pretrain_gpt.py's sampler: accepted
    for layout, named in (
        (_lm_layout(fixed_samples=64), "--outer-transport, --fixed-samples"),
        (_lm_layout(dataloader_type="external"), "--outer-transport, --dataloader-type"),
    ):
        with pytest.raises(ConfigError, match=f"^{named}: "):
            validate_ext_config(cfg, layout)
    driver = ["--cpu", "--outer-lighthouse", "http://127.0.0.1:29510"] + ok
    fixed = parse_args(driver + ["--fixed-samples", "64"])
    with pytest.raises(ConfigError, match="^--outer-transport, --fixed-samples: "):
        validate_ext_config(fixed.ext, driver_layout(fixed, layout_sizes(fixed, 2)))
    parse_args(driver)

    assert cfg.options_for(OuterConfig).num_sites(2) == 1
    if torchft:
        validate_ext_config(cfg, ParallelLayout(data_parallel_size=2))


class _OneSiteTransport:
    """A torchft transport stand-in for one site: every exchange sums this site alone and
    commits; ``heal_from`` (a peer's ``outer_state``) is loaded at the next quorum, as
    torchft's live recovery does."""

    def __init__(self, state_dict, load_state_dict, device):
        self.load_state_dict = load_state_dict
        self.heal_from = None
        self.heal_at = 0  # quorums to pass before healing from heal_from
        self.votes = []  # the next commit votes (then True)
        self.steps = 0

    def quorum(self):
        if self.heal_from is not None and self.heal_at == 0:
            state, self.heal_from = self.heal_from, None
            self.load_state_dict(state)
        self.heal_at -= 1

    def sum_and_commit(self, buf):
        return self.commit()

    def start_sum(self, buf):
        return SimpleNamespace(wait=lambda: None)

    def commit(self):
        vote = self.votes.pop(0) if self.votes else True
        self.steps += vote
        return vote

    def group(self):
        return None

    def report_error(self, exc):
        raise AssertionError(f"no collective fails here: {exc}")

    def num_participants(self):
        return 1

    def step(self):
        return self.steps

    def shutdown(self):
        pass


def _ft_site(seed, transport=None, **options):
    from megatron_ext.optim.diloco_ft import FaultTolerantDiLoCoHook
    from tests.helpers.views import ParamsView

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 4))
    params = dict(model.named_parameters())
    clock = {"step": 0}
    from megatron_ext.options.outer import OuterConfig

    settings = dict(interval=4, fragments=2, transport="torchft", site_id=0, sites=2)
    opts = OuterConfig(**{**settings, **options})
    hook = FaultTolerantDiLoCoHook(opts, make_transport=transport or _OneSiteTransport)
    view = ParamsView(params, clock)
    hook.setup(view)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        inner.zero_grad()
        model(torch.randn(3, 6)).square().mean().backward()
        hook.pre_step(view)
        inner.step()
        hook.post_step(view, True)
        clock["step"] += 1

    return hook, params, step


@pytest.mark.parametrize("delay", [0, 1])
def test_torchft_site_heals_into_the_sites_schedule(delay):
    """A site that heals from a live one (the torchft transport, one-site stand-in) takes
    the live site's step count and the fragment it synchronizes, starts every parameter
    from the received global weights, weighs each fragment by the share of the cycle it
    trained it, and follows the shared schedule; a live site with another schedule is
    refused naming the flags."""
    live, _, live_step = _ft_site(0, delay=delay)
    for _ in range(6):  # the live site: fragment 1 after steps 2 and 6, fragment 0 after 4
        live_step()
    live._at = (6, 1, 6 + delay if delay else None)  # as in its quorum of step 6
    state = live.outer_state()
    site, params, step = _ft_site(1, delay=delay)
    site.transport.heal_from = state
    step()  # joins (heals) before its first step
    assert site._count == 7  # the live site's count, then one step
    joined = [e for e in site.events if e["event"] == "commit"][0]
    assert joined["fragment"] == 1 and joined["weight"] == "0", joined
    events = site.events[:]
    for _ in range(6):  # steps 8 .. 13 of the shared count: fragment 0 after 8 and 12, 1 after 10
        step()
    commits = [e for e in site.events if e["event"] == "commit"][1:]
    assert [c["fragment"] for c in commits] == [0, 1, 0], commits
    # fragment 0's first outer step after the join: half a cycle trained (steps 7, 8)
    assert [c["weight"] for c in commits] == ["0.5", "1", "1"], commits
    assert events[0]["event"] == "healed"
    # the join started every parameter from the received global weights
    fresh, fresh_params, fresh_step = _ft_site(1, delay=delay)
    fresh.transport.heal_from = state
    fresh.pre_step(fresh.outer_view(fresh._raw))
    for name, p in fresh_params.items():
        assert torch.equal(p.detach(), state["snapshot"][name]), name
    # another schedule: refused at the join, naming the flags
    other, _, other_step = _ft_site(1, delay=delay, interval=6)
    other.transport.heal_from = state
    with pytest.raises(ValueError, match="--outer-interval, --outer-fragments, --outer-delay"):
        other_step()


class _SummingSite(_OneSiteTransport):
    """The one-site stand-in that records the size of every buffer it sums; ``peers``: the
    weight the other sites add to the sum (0: every other site joining too)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.sizes = []
        self.peers = 0.0

    def start_sum(self, buf):
        self.sizes.append(buf.numel())
        buf[-1] += self.peers
        return super().start_sum(buf)

    def sum_and_commit(self, buf):
        self.start_sum(buf).wait()
        return self.commit()


@pytest.mark.parametrize("delay", [0, 1])
def test_sites_starting_together_send_no_pseudo_gradient_at_their_join(delay):
    """At a join of sites that start together nobody contributes: before the first commit
    (torchft's step 0) the dense exchange sums the weights alone (one value) and sends no
    model-sized buffer; from the first commit on, one all-reduce of the whole buffer with the
    weight inside (no extra round trip). When a peer did contribute to a step-0 outer step,
    the whole buffer follows the weights' sum."""
    site, params, step = _ft_site(0, _SummingSite, delay=delay, fragments=1)
    numel = sum(p.numel() for p in params.values())
    step()  # the join (overlapped: started before the step, landed after it)
    assert site.transport.sizes == [1], site.transport.sizes
    assert site.transport.step() == 1 and site._inflight is None
    for _ in range(3):  # to the first outer step of the cycle (H = 4): started
        step()
    assert site.transport.sizes == [1, numel + 1], site.transport.sizes
    # a step-0 outer step that a peer contributed to: the weights' sum, then the buffer
    other, _, _ = _ft_site(0, _SummingSite, fragments=1)
    other.transport.peers = 1.0
    other.pre_step(other.outer_view(other._raw))
    assert other.transport.sizes == [1, numel + 1], other.transport.sizes
    commit = [e for e in other.events if e["event"] == "commit"][0]
    assert commit["total_weight"] == "1" and commit["weight"] == "0", commit


def test_exchanges_and_transports_implement_their_contracts():
    """The outer step's contracts (megatron_ext/protocols.py): both exchanges are
    PseudoGradientExchanges, the dense one asynchronous, the compressed one staged (what
    the sites' outer step needs of it); the torchft transport and the tests' stand-in are
    SitesTransports."""
    from megatron_ext.collectives.outer_exchange import OuterExchange
    from megatron_ext.optim.diloco_ft import TorchftTransport
    from megatron_ext.protocols import (
        AsynchronousPseudoGradientExchange,
        PseudoGradientExchange,
        SitesTransport,
        StagedPseudoGradientExchange,
        is_asynchronous,
    )

    dense = make_outer_exchange("none", None, 4, None, "cpu")
    from megatron_ext.optim.diloco_ft import _local_exchange

    shapes = [("w", (8, 8))]
    compressed = _local_exchange("quantized", None, 64, None, "cpu", name="outer/0", shapes=shapes)
    assert isinstance(dense, PseudoGradientExchange) and is_asynchronous(dense)
    assert isinstance(dense, AsynchronousPseudoGradientExchange)
    assert not isinstance(dense, StagedPseudoGradientExchange)
    assert isinstance(compressed, OuterExchange)
    assert isinstance(compressed, StagedPseudoGradientExchange)
    assert not is_asynchronous(compressed)
    assert not isinstance(compressed, AsynchronousPseudoGradientExchange)
    for transport in (TorchftTransport, _OneSiteTransport):
        assert issubclass(transport, SitesTransport), transport


def test_outer_step_names_what_it_lacks(monkeypatch):
    """The outer step's contracts refuse naming the cause (each was an AttributeError on
    None, or a failure at the first outer step): a view asked for the state of a parameter
    another rank holds, the sites' hook before setup or after finish, a compressed
    fragment exchange that cannot stage its error feedback for the sites' vote (at setup,
    before training)."""
    from megatron_ext.optim import diloco_ft
    from megatron_ext.optim.diloco_ft import FaultTolerantDiLoCoHook
    from megatron_ext.options.outer import OuterConfig
    from tests.helpers.views import ParamsView

    class _Sharded(ParamsView):  # another rank holds all of "b"
        def param_state(self, fqn):
            return None if fqn == "b" else super().param_state(fqn)

    params = {name: torch.nn.Parameter(torch.ones(2)) for name in ("a", "b")}
    view = _Sharded(params, {"step": 0})
    assert view.owned_state("a").fqn == "a"
    with pytest.raises(KeyError, match="holds no optimizer state of 'b'"):
        view.owned_state("b")

    opts = OuterConfig(interval=4, fragments=2, transport="torchft", site_id=0, sites=2)
    unset = FaultTolerantDiLoCoHook(opts, make_transport=_OneSiteTransport)
    with pytest.raises(RuntimeError, match="no transport \\(used before setup"):
        unset.sites
    site, _, _ = _ft_site(0, compression="quantized")  # compressed: staged exchanges
    assert site.sites is site.transport
    site.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        site.sites

    def dense(method, options, numel, group, device, **layout):  # stages nothing
        return make_outer_exchange("none", None, numel, group, device)

    monkeypatch.setattr(diloco_ft, "_local_exchange", dense)
    with pytest.raises(TypeError, match="fragment 0 \\(DenseOuterExchange\\) cannot stage"):
        _ft_site(0, compression="quantized")


def test_torchft_site_whose_vote_failed_heals_at_the_retry():
    """torchft's commit vote is per site: a site whose exchange failed while the others
    committed is behind, and torchft heals it at its next quorum (the retry of the same
    outer step). It then takes the others' count and fragment, contributes nothing, and
    holds the global weights everywhere (its own progress since is dropped)."""
    live, _, live_step = _ft_site(0)
    for _ in range(16):  # the others' next outer step: fragment 0's, after step 16
        live_step()
    live._at = (16, 0, None)
    state = live.outer_state()
    site, params, step = _ft_site(0)
    for _ in range(13):
        step()
    site.transport.votes = [False]  # its outer step after step 14 (fragment 1) fails ...
    site.transport.heal_from, site.transport.heal_at = state, 1  # ... healed at the retry
    step()
    kinds = [e["event"] for e in site.events[-3:]]
    assert kinds == ["retry", "healed", "commit"], site.events[-3:]
    last = site.events[-1]
    assert last["fragment"] == 0 and last["weight"] == "0", last
    assert site._count == 16
    for name, p in params.items():
        assert torch.equal(p.detach(), state["snapshot"][name]), name
