"""DiLoCo sites that fail alone against one world: the time a killed site costs, measured.

What it does:
    Trains gpt-tiny with DiLoCo across ``--sites`` sites of one rank each (the driver,
    ``python -m megatron_ext.train --cpu``, one thread per rank, the same model, seed, batch
    per site and schedule in every run), only the links between sites shaped to ``--rate``
    (inside network namespaces: :class:`megatron_ext.netbench.SiteJobsNetwork` for separate
    site jobs, :class:`megatron_ext.netbench.ShapedNetwork` with the ``sites`` scope for the
    one-world run), in three scenarios:

    * ``a`` (torchft, uninterrupted): every site its own job (``--outer-transport
      torchft``), a lighthouse in its own namespace reachable from every site;
    * ``b`` (torchft, one site killed): the same; the last site is SIGKILLed once it has
      logged ``--iters / 3`` iterations and started again, with ``--load`` of its own last
      checkpoint (every site runs with ``--save`` / ``--save-interval``, as a user would),
      once the first site has logged ``2 * --iters / 3``: it heals from a live peer and
      trains to ``--iters``, alone at the end if the others are done. The lighthouse runs
      with ``--min-replicas 1``; the quorum each site needs (``--outer-min-sites``): all
      sites in ``a`` (the sites start in step: the first outer step waits for every site,
      however far apart their start-ups on a loaded machine), in ``b`` ``sites - 1`` for
      the survivors (they go on without the killed site) and 1 for the killed site, at its
      start and its restart (it must finish alone, and a checkpoint loads only into the
      settings it was saved with). Sites of ``b`` that start far apart may join at
      different outer steps (the late one heals at its join): ``sites_in_first_outer_step``
      records, per site, how many sites its first outer step had;
    * ``c`` (one world, today's alternative): one torch.distributed world of all the ranks
      (``--outer-transport world``, the default, ``--outer-groups`` = sites), ``--save`` /
      ``--save-interval``; the last rank is SIGKILLed at ``--iters / 3``, the other ranks are
      stopped at once (what torchrun does when a worker dies) and the world is started again
      at once with ``--load``;
    * ``w`` (one world, uninterrupted): ``c`` without the kill, ``c``'s reference.

    Measured, from each job's stdout (the driver's timestamped iteration lines, its
    ``log.jsonl`` for the losses, torchft's commit lines with their unix times) against the
    wall clock of the run's start: each site's loss curve against wall time and iterations,
    each job's exit code and finish time, and the time lost per failure. For ``b``: the
    survivors' time from the kill to their next completed iteration and to their next
    committed outer step, the duration of their first outer step after the kill against
    their median one before it, the restarted site's time from its restart to its first
    outer step (where it heals), and the extra wall time to finish against ``a`` (the
    survivors' and the last site's). For ``c``: the wall time from the kill to regaining
    the last iteration logged before it, the iterations redone (since the last checkpoint)
    and what they had cost before the kill, the time from the kill to the restarted world's
    first iteration, and the extra wall time against ``w``. The final loss of a run is the
    mean over its sites of the mean of the last 10% of each site's logged losses (each
    site's own data; one world: the logged loss, averaged over its ranks).
    ``sites_ft.json`` (the layout of :func:`benchmarks.common.make_report`) is written after
    every scenario; a table is printed at the end.

Usage:
    python benchmarks/sites_ft.py --iters 60 --interval 10 --rate 100mbit
    python benchmarks/sites_ft.py --quick     # smoke run: scenario a, 2 sites, 4 steps

Constraints:
    Needs what netbench needs (Linux, root, iproute2, network namespaces, ``unshare``) and
    torchft; refuses with the reason otherwise (exit code 2). A job that fails, or a scenario
    whose kill or restart could not happen as planned, makes the scenario ``failed`` with
    the job's last lines (exit code 1). On a small machine the ranks share the CPUs: CPU
    contention shapes the timings as much as the link (three ranks on two cores here).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

__all__ = ["parse_iterations", "parse_commits", "site_curve", "time_lost", "build_parser", "main"]

FINAL_FRACTION = 0.1
"""Share of a site's logged iterations whose mean loss is its final loss."""

LIGHTHOUSE_PORT = 29510
QUICK_DEFAULTS = {"scenarios": "a", "sites": 2, "iters": 4, "interval": 2, "save_interval": 0}
"""``--quick``'s defaults; flags given explicitly still win."""

_ITER_LINE = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\] iteration\s+(\d+)/")
_COMMIT_LINE = re.compile(r"megatron-ext: torchft site (\d+): commit (.*) at ([0-9.]+)$")


# -- reading a job's output -------------------------------------------------------------------


def parse_iterations(text: str) -> List[Dict[str, Any]]:
    """``[{"iteration", "time"}]`` of a driver's stdout: its timestamped iteration lines
    (local time of this machine, as unix seconds)."""
    out = []
    for line in text.splitlines():
        m = _ITER_LINE.search(line)
        if m:
            ts = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()
            out.append({"iteration": int(m.group(2)), "time": ts})
    return out


def parse_commits(text: str) -> List[Dict[str, Any]]:
    """torchft's commit lines of a site's stdout: their fields and unix time."""
    out = []
    for line in text.splitlines():
        m = _COMMIT_LINE.search(line.strip())
        if m:
            fields = dict(f.split("=", 1) for f in m.group(2).split() if "=" in f)
            out.append(dict(fields, time=float(m.group(3))))
    return out


def _read_jsonl(path: str) -> List[Dict[str, Any]]:
    """Records of a ``log.jsonl``; a line cut by a SIGKILL is skipped."""
    out = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def _last_iteration(path: str) -> int:
    try:
        with open(path, errors="replace") as f:
            found = parse_iterations(f.read())
    except OSError:
        return 0
    return found[-1]["iteration"] if found else 0


def site_curve(launches: Sequence[Dict[str, Any]], t0: float, iters: int) -> Dict[str, Any]:
    """One site's (or world's) curve over its launches: per logged iteration its wall time
    since ``t0``, loss, launch index; a later launch's records of an iteration replace
    nothing (redone iterations appear twice, in order)."""
    points = []
    for k, launch in enumerate(launches):
        losses = {r["iteration"]: r.get("lm_loss") for r in _read_jsonl(launch["log_json"])}
        with open(launch["stdout"], errors="replace") as f:
            its = parse_iterations(f.read())
        for it in its:
            points.append(
                {
                    "launch": k,
                    "iteration": it["iteration"],
                    "wall_s": it["time"] - t0,
                    "lm_loss": losses.get(it["iteration"]),
                }
            )
    losses = [p["lm_loss"] for p in points if p["lm_loss"] is not None]
    n = max(1, int(round(FINAL_FRACTION * iters)))
    done = points[-1]["iteration"] if points else 0
    return {
        "curve": {k: [p[k] for p in points] for k in ("launch", "iteration", "wall_s", "lm_loss")},
        "last_iteration": done,
        "final_loss": sum(losses[-n:]) / len(losses[-n:]) if losses and done >= iters else None,
    }


def time_lost(
    survivors: Sequence[Dict[str, Any]], kill_s: float, interval: int
) -> Dict[str, Optional[float]]:
    """Survivors' delays after a kill at ``kill_s`` (seconds since the run's start).

    The duration of an outer step is the time between the logged iterations ``kH - 1`` and
    ``kH`` (iteration ``kH`` ends with the outer step: quorum, exchange, commit).

    Args:
        survivors: Per survivor ``{"iteration": [...], "wall_s": [...], "commit_s": [...]}``
            (its logged iterations and their times, its committed outer steps' times).
        kill_s: When the kill happened.
        interval: DiLoCo's H.

    Returns:
        The largest over the survivors of: the time from the kill to its next completed
        iteration and to its next committed outer step, the duration of its first outer
        step after the kill, and its median outer-step and inner-step durations before it.
    """
    out: Dict[str, List[float]] = {
        "kill_to_next_iteration_s": [],
        "kill_to_next_outer_commit_s": [],
        "next_outer_step_s": [],
        "median_outer_step_before_kill_s": [],
        "median_inner_step_before_kill_s": [],
    }
    for s in survivors:
        at = dict(zip(s["iteration"], s["wall_s"]))
        after = [t for t in s["wall_s"] if t > kill_s]
        if after:
            out["kill_to_next_iteration_s"].append(after[0] - kill_s)
        later = [t for t in s["commit_s"] if t > kill_s]
        if later:
            out["kill_to_next_outer_commit_s"].append(later[0] - kill_s)
        outer, inner = [], []
        for it, t in at.items():
            if it - 1 not in at:
                continue
            if it % interval == 0:
                outer.append((t, t - at[it - 1]))
            elif t <= kill_s:
                inner.append(t - at[it - 1])
        before = [d for t, d in outer if t <= kill_s]
        first_after = [d for t, d in outer if t > kill_s][:1]
        out["next_outer_step_s"] += first_after
        if before:
            out["median_outer_step_before_kill_s"].append(statistics.median(before))
        if inner:
            out["median_inner_step_before_kill_s"].append(statistics.median(inner))
    return {k: (max(v) if v else None) for k, v in out.items()}


# -- commands ---------------------------------------------------------------------------------


def train_command(args: argparse.Namespace, run_dir: str, tag: str, ranks: int = 1) -> List[str]:
    """A job's driver command (``ranks`` sites of one rank; ``tag`` names its checkpoints):
    ``--batch`` sequences per site and step."""
    cmd = [sys.executable, "-m", "megatron_ext.train", "--cpu", "--model", args.model]
    cmd += ["--num-threads", str(args.num_threads)]
    cmd += ["--micro-batch-size", str(args.batch)]
    cmd += ["--global-batch-size", str(args.batch * ranks)]
    cmd += ["--train-iters", str(args.iters)]
    cmd += common.lr_schedule_flags(args, max(1, args.iters // 10)) + ["--eval-iters", "0"]
    cmd += ["--log-interval", "1", "--no-progress"]
    cmd += ["--outer-method", "diloco", "--outer-interval", str(args.interval)]
    if args.save_interval:
        cmd += ["--save", os.path.join(run_dir, f"ckpt-{tag}")]
        cmd += ["--save-interval", str(args.save_interval)]
    return cmd


def _site_command(args, run_dir, site, lighthouse, log_json, min_sites):
    cmd = train_command(args, run_dir, f"site{site}")
    cmd += ["--log-json", log_json, "--outer-transport", "torchft"]
    cmd += ["--outer-site-id", str(site), "--outer-sites", str(args.sites)]
    cmd += ["--outer-lighthouse", lighthouse, "--outer-min-sites", str(min_sites)]
    cmd += ["--outer-timeout", "60", "--outer-quorum-timeout", "600"]
    return cmd


def _world_command(args, run_dir, log_json):
    cmd = train_command(args, run_dir, "world", args.sites)
    cmd += ["--log-json", log_json, "--outer-groups", str(args.sites)]
    return cmd


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def _killpg(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    proc.wait()


class _Failed(RuntimeError):
    """A scenario could not run as planned (the message says why)."""


class _Done(Exception):
    """An uninterrupted run ended (no kill to do)."""


def _wait(cond, what: str, procs: Dict[str, subprocess.Popen], logs: Dict[str, str], timeout):
    deadline = time.monotonic() + timeout
    while not cond():
        for name, p in procs.items():
            if p.poll() not in (None, 0):
                raise _Failed(
                    f"{name} exited with {p.returncode} while waiting for {what}: "
                    f"{_tail(logs[name])}"
                )
        if time.monotonic() > deadline:
            raise _Failed(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


# -- scenarios --------------------------------------------------------------------------------


def run_torchft(args: argparse.Namespace, out: str, scenario: str) -> Dict[str, Any]:
    """Scenario ``a`` (``kill=False``) or ``b``: site jobs, a lighthouse, optionally a
    kill and restart of the last site."""
    from megatron_ext.netbench import SiteJobsNetwork

    kill = scenario == "b"
    run_dir = os.path.join(out, "runs", scenario)
    os.makedirs(run_dir, exist_ok=True)
    victim = args.sites - 1
    result: Dict[str, Any] = {"scenario": scenario, "transport": "torchft", "commands": {}}
    procs: Dict[str, subprocess.Popen] = {}
    logs: Dict[str, str] = {}
    launches: Dict[int, List[Dict[str, Any]]] = {s: [] for s in range(args.sites)}
    files = []
    with SiteJobsNetwork(args.sites, bandwidth=args.rate) as net:
        # Shaped site-to-site links, one site-to-lighthouse link (unshaped), and one inside
        # a site (to its own address: what the ranks of a site use; never shaped).
        checks = net.network.check_links(args.check_seconds, max_links=2)
        checks.append(net.network.measure_link(0, 0, args.check_seconds))
        result["link_check"] = [vars(m) for m in checks]
        lighthouse = f"http://{net.lighthouse_host}:{LIGHTHOUSE_PORT}"
        lh_cmd = [sys.executable, "-m", "megatron_ext", "lighthouse", "--min-replicas", "1"]
        lh_cmd += ["--bind", f"{net.lighthouse_host}:{LIGHTHOUSE_PORT}"]
        lh_cmd += ["--join-timeout-ms", "60000", "--heartbeat-timeout-ms", "2000"]
        logs["lighthouse"] = os.path.join(run_dir, "lighthouse.txt")
        f = open(logs["lighthouse"], "w")
        files.append(f)
        result["commands"]["lighthouse"] = common.shell_join(lh_cmd)

        def start(site: int, extra: Sequence[str] = ()) -> None:
            k = len(launches[site])
            name = f"site{site}" + (f"-launch{k}" if k else "")
            log_json = os.path.join(run_dir, f"{name}.jsonl")
            min_sites = args.sites if not kill else 1 if site == victim else args.sites - 1
            cmd = _site_command(args, run_dir, site, lighthouse, log_json, min_sites)
            cmd += list(extra)
            logs[name] = os.path.join(run_dir, f"{name}.txt")
            fh = open(logs[name], "w")
            files.append(fh)
            procs[name] = net.start_site(site, cmd, stdout=fh, stderr=subprocess.STDOUT)
            launches[site].append({"stdout": logs[name], "log_json": log_json, "name": name})
            result["commands"][name] = common.shell_join(cmd)

        t0 = time.time()
        try:
            procs["lighthouse"] = net.start_lighthouse(lh_cmd, stdout=f, stderr=subprocess.STDOUT)
            for site in range(args.sites):
                start(site)
            if kill:
                third = max(1, args.iters // 3)
                _wait(
                    lambda: _last_iteration(logs[f"site{victim}"]) >= third,
                    f"site {victim}'s iteration {third}",
                    procs,
                    logs,
                    args.run_timeout,
                )
                killed_after = _last_iteration(logs[f"site{victim}"])
                _killpg(procs.pop(f"site{victim}"))
                result["kill_s"] = time.time() - t0
                result["killed_after_iteration"] = killed_after
                two = max(third + 1, 2 * args.iters // 3)
                _wait(
                    lambda: _last_iteration(logs["site0"]) >= two,
                    f"site 0's iteration {two}",
                    procs,
                    logs,
                    args.run_timeout,
                )
                ckpt = os.path.join(run_dir, f"ckpt-site{victim}")
                if not os.path.isdir(ckpt):
                    raise _Failed(f"site {victim} saved no checkpoint before its kill ({ckpt})")
                result["restart_s"] = time.time() - t0
                result["survivor_iteration_at_restart"] = _last_iteration(logs["site0"])
                start(victim, ["--load", ckpt])
            finish: Dict[str, float] = {}
            deadline = time.monotonic() + args.run_timeout
            while len(finish) < len(procs) - 1:
                for name, p in procs.items():
                    if name == "lighthouse" or name in finish or p.poll() is None:
                        continue
                    if p.returncode != 0:
                        raise _Failed(f"{name} exited with {p.returncode}: {_tail(logs[name])}")
                    finish[name] = time.time() - t0
                if time.monotonic() > deadline:
                    raise _Failed(f"timed out after {args.run_timeout:.0f} s")
                time.sleep(0.1)
            result["status"] = "ok"
        except _Failed as exc:
            result.update(status="failed", error=str(exc)[-3000:])
            finish = {}
        finally:
            for name, p in procs.items():
                if p.poll() is None:
                    _killpg(p)
            for fh in files:
                fh.close()
    result["finish_s"] = finish
    sites = []
    for site in range(args.sites):
        curve = site_curve(launches[site], t0, args.iters)
        texts = []
        for launch in launches[site]:
            with open(launch["stdout"], errors="replace") as fh:
                texts.append(fh.read())
        curve["commits"] = [
            dict(c, wall_s=c["time"] - t0, launch=k)
            for k, text in enumerate(texts)
            for c in parse_commits(text)
        ]
        curve["healed"] = any("healed" in text for text in texts[1:])
        sites.append(dict(curve, site=site))
    result["sites"] = sites
    # Sites that start apart (CPU contention at start-up) may join at different outer steps.
    result["sites_in_first_outer_step"] = [
        int(s["commits"][0]["sites"]) if s["commits"] else None for s in sites
    ]
    if result["status"] == "ok":
        result["final_loss"] = _mean([s["final_loss"] for s in sites])
        result["wall_s"] = max(finish.values())
        if kill:
            surv = [
                {
                    "iteration": s["curve"]["iteration"],
                    "wall_s": s["curve"]["wall_s"],
                    "commit_s": [c["wall_s"] for c in s["commits"]],
                }
                for s in sites[:victim]
            ]
            result.update(time_lost(surv, result["kill_s"], args.interval))
            result["survivors_finish_s"] = max(
                finish[f"site{s}"] for s in range(args.sites) if s != victim
            )
            result["restarted_finish_s"] = finish[launches[victim][-1]["name"]]
            rejoin = [c["wall_s"] for c in sites[victim]["commits"] if c["launch"] == 1]
            result["restart_to_rejoin_s"] = rejoin[0] - result["restart_s"] if rejoin else None
            if not sites[victim]["healed"]:
                result.update(status="failed", error="the restarted site did not heal")
    return result


def run_world(args: argparse.Namespace, out: str, scenario: str = "c") -> Dict[str, Any]:
    """Scenario ``c``: one world, a rank killed at a third, restarted from its checkpoint;
    ``w``: the same world uninterrupted (``c``'s reference)."""
    from megatron_ext.netbench import ShapedNetwork
    from megatron_ext.netbench.topology import ParallelLayout

    kill = scenario == "c"
    run_dir = os.path.join(out, "runs", scenario)
    os.makedirs(run_dir, exist_ok=True)
    n = args.sites
    pairs = ParallelLayout(world_size=n, sites=n).pairs("sites")
    result: Dict[str, Any] = {"scenario": scenario, "transport": "world", "commands": {}}
    launches: List[Dict[str, Any]] = []
    files = []
    with ShapedNetwork(n, bandwidth=args.rate, shaped_pairs=pairs) as net:
        result["link_check"] = [vars(m) for m in net.check_links(args.check_seconds, max_links=2)]

        def start(extra: Sequence[str] = ()) -> List[subprocess.Popen]:
            k = len(launches)
            log_json = os.path.join(run_dir, f"world-launch{k}.jsonl")
            cmd = _world_command(args, run_dir, log_json) + list(extra)
            procs = []
            for rank in range(n):
                path = os.path.join(run_dir, f"world-launch{k}-rank{rank}.txt")
                fh = open(path, "w")
                files.append(fh)
                procs.append(
                    net.start(rank, cmd, net.rank_env(rank), stdout=fh, stderr=subprocess.STDOUT)
                )
            last = os.path.join(run_dir, f"world-launch{k}-rank{n - 1}.txt")
            launches.append({"stdout": last, "log_json": log_json, "procs": procs})
            result["commands"][f"launch{k}"] = common.shell_join(cmd)
            return procs

        t0 = time.time()
        try:
            procs = start()
            names = {f"rank{r}": p for r, p in enumerate(procs)}
            logs = {
                f"rank{r}": launches[0]["stdout"].replace(f"rank{n - 1}", f"rank{r}")
                for r in range(n)
            }
            third = max(1, args.iters // 3) if kill else args.iters + 1
            _wait(
                lambda: (
                    _last_iteration(launches[0]["stdout"]) >= third
                    or all(p.poll() == 0 for p in procs)
                ),
                f"iteration {third}",
                names,
                logs,
                args.run_timeout,
            )
            if not kill:
                result.update(finish_s={"world": time.time() - t0}, status="ok")
                raise _Done
            killed_after = _last_iteration(launches[0]["stdout"])
            _killpg(procs[n - 1])
            result["kill_s"] = time.time() - t0
            result["killed_after_iteration"] = killed_after
            for p in procs[:-1]:  # the world is down: torchrun stops the other workers
                _killpg(p)
            ckpt = os.path.join(run_dir, "ckpt-world")
            if not os.path.isdir(ckpt):
                raise _Failed(f"no checkpoint saved before the kill ({ckpt})")
            result["restart_s"] = time.time() - t0
            procs = start(["--load", ckpt])
            names = {f"rank{r}": p for r, p in enumerate(procs)}
            logs = {
                f"rank{r}": launches[1]["stdout"].replace(f"rank{n - 1}", f"rank{r}")
                for r in range(n)
            }
            _wait(
                lambda: all(p.poll() == 0 for p in procs), "the end", names, logs, args.run_timeout
            )
            result["finish_s"] = {"world": time.time() - t0}
            result["status"] = "ok"
        except _Failed as exc:
            result.update(status="failed", error=str(exc)[-3000:])
        except _Done:
            pass
        finally:
            for launch in launches:
                for p in launch["procs"]:
                    if p.poll() is None:
                        _killpg(p)
            for fh in files:
                fh.close()
    for launch in launches:
        launch.pop("procs")
    curve = site_curve(launches, t0, args.iters)
    result["sites"] = [dict(curve, site="world")]
    if result["status"] == "ok":
        result["final_loss"] = curve["final_loss"]
        result["wall_s"] = result["finish_s"]["world"]
    if result["status"] == "ok" and kill:
        c = curve["curve"]
        first = [(i, w) for k, i, w in zip(c["launch"], c["iteration"], c["wall_s"]) if k == 0]
        second = [(i, w) for k, i, w in zip(c["launch"], c["iteration"], c["wall_s"]) if k == 1]
        if not second:
            result.update(status="failed", error="the restarted world logged nothing")
            return result
        resumed_from = second[0][0] - 1
        before = {i: w for i, w in first}
        regained = next((w for i, w in second if i >= result["killed_after_iteration"]), None)
        result.update(
            checkpoint_iteration=resumed_from,
            iterations_redone=result["killed_after_iteration"] - resumed_from,
            redone_work_before_kill_s=(
                before[result["killed_after_iteration"]] - before[resumed_from]
                if resumed_from in before
                else None
            ),
            kill_to_first_iteration_after_restart_s=second[0][1] - result["kill_s"],
            kill_to_regained_iteration_s=(
                regained - result["kill_s"] if regained is not None else None
            ),
        )
    return result


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


# -- report -----------------------------------------------------------------------------------


def add_comparisons(results: List[Dict[str, Any]]) -> None:
    """``extra_wall_s``: the wall time against the same transport's uninterrupted run
    (``b`` against ``a``, with the survivors' one; ``c`` against ``w``)."""
    ok = {r["scenario"]: r for r in results if r["status"] == "ok"}
    for r in results:
        r["extra_wall_s"] = None
        base = ok.get({"b": "a", "c": "w"}.get(r["scenario"], ""))
        if base is None or r["status"] != "ok":
            continue
        r["extra_wall_s"] = r["wall_s"] - base["wall_s"]
        if "survivors_finish_s" in r:
            r["survivors_extra_wall_s"] = r["survivors_finish_s"] - base["wall_s"]


def print_table(results: List[Dict[str, Any]], file=None) -> None:
    """One row per scenario (a markdown table), then the failures."""
    rows = []
    for r in results:
        rows.append(
            [
                r["scenario"],
                r["transport"],
                r["status"],
                r.get("final_loss"),
                r.get("wall_s"),
                r.get("extra_wall_s"),
                r.get("survivors_extra_wall_s"),
                r.get("next_outer_step_s"),
                r.get("median_outer_step_before_kill_s"),
                r.get("kill_to_regained_iteration_s"),
                r.get("iterations_redone"),
            ]
        )
    header = ["scenario", "transport", "status", "final loss", "wall s", "extra s"]
    header += ["survivors' extra s", "outer step after kill s", "outer step before s"]
    header += ["kill->regained iter s", "iters redone"]
    print(common.format_table(header, rows), file=file)
    for r in results:
        if r["status"] != "ok":
            print(f"{r['scenario']} failed: {r.get('error')}", file=file)


def build_parser() -> argparse.ArgumentParser:
    """Options of ``benchmarks/sites_ft.py``."""
    p = argparse.ArgumentParser(
        prog="benchmarks/sites_ft.py",
        description="DiLoCo across sites with a site killed: separate site jobs over torchft "
        "against one world restarted from its checkpoint (inside netbench; needs root).",
    )
    p.add_argument("--scenarios", default="a,b,w,c", help="Any of a, b, w, c (default a,b,w,c).")
    p.add_argument("--sites", type=int, default=3, help="Sites of one rank each (3).")
    p.add_argument("--rate", default="100mbit", help="Inter-site link rate, tc syntax.")
    p.add_argument("--iters", type=int, default=60, help="Training iterations per site (60).")
    p.add_argument("--interval", type=int, default=10, help="DiLoCo's H (10).")
    p.add_argument("--save-interval", type=int, default=15, help="Checkpoint interval (15).")
    p.add_argument("--batch", type=int, default=4, help="Sequences per step per site (4).")
    common.add_lr_schedule_args(p)
    common.add_run_args(p, run_timeout=1800.0, extra_train_args=False, link_checks=True)
    p.add_argument("--quick", action="store_true", help="Smoke run: a, 2 sites, 4 steps, H 2.")
    p.add_argument("--out", default=None, help="Run directory (runs/bench-sites_ft-<time>).")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point: 0 when every scenario ran as planned, 1 otherwise, 2 on bad arguments or
    without netbench / torchft."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**QUICK_DEFAULTS)
        args = parser.parse_args(argv)
    scenarios = common.parse_list(args.scenarios)
    bad = [s for s in scenarios if s not in ("a", "b", "c", "w")]
    problems = []
    if bad or not scenarios:
        problems.append(f"--scenarios: expected a, b, c and/or w, got {args.scenarios!r}")
    if args.sites < 2 or args.iters < 3 or args.interval < 1 or args.save_interval < 0:
        problems.append("--sites >= 2, --iters >= 3, --interval >= 1, --save-interval >= 0")
    if {"b", "c"} & set(scenarios) and not 0 < args.save_interval < args.iters // 3:
        problems.append("--save-interval: scenarios b and c need a checkpoint before a third")
    if problems:
        print(f"sites_ft.py: error: {problems[0]}")
        return 2
    from megatron_ext.netbench.netns import netns_unavailable_reason
    from megatron_ext.optim.diloco_ft import torchft_missing

    reason = netns_unavailable_reason() or torchft_missing()
    if reason:
        print(f"sites_ft.py: error: this benchmark needs netbench and torchft: {reason}")
        return 2
    report = common.SweepReport("sites_ft", args)
    out, settings = report.out, report.settings
    settings["final_loss_definition"] = (
        "mean over the sites of the mean of the last 10% of each site's logged losses"
    )
    settings["time_definition"] = (
        "wall seconds since the run's start (the driver's timestamp of each logged iteration, "
        "torchft's commit times, process exits seen by the benchmark)"
    )
    results: List[Dict[str, Any]] = []
    for scenario in scenarios:
        print(f"[{scenario}] {args.sites} sites, {args.rate}, {args.iters} steps", flush=True)
        if scenario in ("c", "w"):
            res = run_world(args, out, scenario)
        else:
            res = run_torchft(args, out, scenario)
        results.append(res)
        add_comparisons(results)
        print(f"    -> {res['status']}, wall {res.get('wall_s') or 0.0:.1f} s", flush=True)
        report.write(results)
    print()
    print_table(results)
    with open(os.path.join(out, "sites_ft.md"), "w") as f:
        given = list(argv) if argv is not None else sys.argv[1:]
        f.write(f"`{common.shell_join(['python', 'benchmarks/sites_ft.py'] + given)}`\n\n")
        print_table(results, file=f)
    print(f"\nreport: {report.path} (table: sites_ft.md)")
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
