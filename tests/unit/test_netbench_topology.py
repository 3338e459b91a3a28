"""Unit tests of netbench's pure parts: rank layout, pair scopes, rate syntax, tc commands.

None of these needs root or creates a namespace; the commands that
:class:`megatron_ext.netbench.netns.ShapedNetwork` runs are checked as argument lists.
"""

import pytest

from megatron_ext.netbench import cli
from megatron_ext.netbench.netns import ShapedNetwork, rank_command
from megatron_ext.netbench.shaping import (
    LinkShape,
    format_rate,
    parse_loss,
    parse_rate,
    parse_time,
    tbf_burst_bytes,
    tc_commands,
)
from megatron_ext.netbench.topology import (
    PAIR_DP,
    PAIR_OTHER,
    PAIR_PP,
    PAIR_TP,
    ParallelLayout,
    RankCoord,
    select_check_links,
)

# ---------------------------------------------------------------------------- layout


def test_world4_tp1_pp2_mapping_and_classes():
    layout = ParallelLayout(4, tp_size=1, pp_size=2)
    assert layout.dp_size == 2
    assert [layout.coord(r) for r in range(4)] == [
        RankCoord(tp_rank=0, dp_rank=0, pp_rank=0),
        RankCoord(tp_rank=0, dp_rank=1, pp_rank=0),
        RankCoord(tp_rank=0, dp_rank=0, pp_rank=1),
        RankCoord(tp_rank=0, dp_rank=1, pp_rank=1),
    ]
    assert layout.classify(0, 1) == PAIR_DP
    assert layout.classify(0, 2) == PAIR_PP
    assert layout.classify(1, 2) == PAIR_PP
    assert layout.pairs("dp") == {(0, 1), (1, 0), (2, 3), (3, 2)}
    assert layout.pairs("pp") == {(s, d) for s in (0, 1) for d in (2, 3)} | {
        (d, s) for s in (0, 1) for d in (2, 3)
    }
    assert len(layout.pairs("all")) == 12


def test_world4_tp2_pp1_mapping_and_classes():
    layout = ParallelLayout(4, tp_size=2, pp_size=1)
    assert layout.dp_size == 2
    assert [(c.tp_rank, c.dp_rank, c.pp_rank) for c in map(layout.coord, range(4))] == [
        (0, 0, 0),
        (1, 0, 0),
        (0, 1, 0),
        (1, 1, 0),
    ]
    assert layout.classify(0, 1) == PAIR_TP
    assert layout.classify(0, 2) == PAIR_DP
    assert layout.classify(0, 3) == PAIR_OTHER
    assert layout.pairs("dp") == {(0, 2), (2, 0), (1, 3), (3, 1)}
    assert layout.pairs("pp") == frozenset()


def test_world8_tp2_pp2_matches_megatron_formula():
    layout = ParallelLayout(8, tp_size=2, pp_size=2)
    assert layout.dp_size == 2
    for rank in range(8):
        c = layout.coord(rank)
        assert rank == c.pp_rank * (2 * 2) + c.dp_rank * 2 + c.tp_rank
        assert layout.rank_of(c.tp_rank, c.dp_rank, c.pp_rank) == rank
    # Megatron's groups for this layout: TP {0,1},{2,3},...; DP {0,2},{1,3},{4,6},{5,7};
    # pipeline {0,4},{1,5},{2,6},{3,7}.
    assert layout.pairs("dp") == {
        p for a, b in ((0, 2), (1, 3), (4, 6), (5, 7)) for p in ((a, b), (b, a))
    }
    assert layout.classify(0, 4) == PAIR_PP
    assert layout.classify(3, 7) == PAIR_PP
    assert layout.classify(6, 7) == PAIR_TP
    assert layout.classify(4, 7) == PAIR_OTHER
    pp_pairs = layout.pairs("pp")
    assert len(pp_pairs) == 2 * 4 * 4
    assert all(layout.coord(s).pp_rank != layout.coord(d).pp_rank for s, d in pp_pairs)


@pytest.mark.parametrize(
    "world,tp,pp", [(6, 4, 1), (4, 1, 3), (0, 1, 1), (4, 0, 1), (4, 1, -1), (4.0, 1, 1)]
)
def test_layout_rejects_bad_sizes(world, tp, pp):
    with pytest.raises(ValueError):
        ParallelLayout(world, tp_size=tp, pp_size=pp)


def test_layout_rejects_bad_ranks_and_scopes():
    layout = ParallelLayout(4)
    with pytest.raises(ValueError):
        layout.coord(4)
    with pytest.raises(ValueError):
        layout.classify(1, 1)
    with pytest.raises(ValueError):
        layout.pairs("tp")


def test_select_check_links_covers_each_sender_then_caps():
    layout = ParallelLayout(4, tp_size=1, pp_size=2)
    shaped, unshaped = select_check_links(4, set(layout.pairs("pp")), max_links=4)
    assert len(shaped) == 4
    assert sorted(s for s, _ in shaped) == [0, 1, 2, 3]
    assert all(p in layout.pairs("pp") for p in shaped)
    assert unshaped is not None and unshaped not in layout.pairs("pp")

    all_pairs = set(ParallelLayout(8).pairs("all"))
    shaped, unshaped = select_check_links(8, all_pairs, max_links=3)
    assert shaped == [(0, 1), (1, 2), (2, 3)]
    assert unshaped is None

    shaped, _ = select_check_links(2, {(0, 1), (1, 0)}, max_links=4)
    assert shaped == [(0, 1), (1, 0)]
    shaped, unshaped = select_check_links(3, set(), max_links=4)
    assert shaped == [] and unshaped == (0, 1)


# ---------------------------------------------------------------------------- syntax


@pytest.mark.parametrize(
    "text,bits",
    [
        ("100mbit", 100_000_000),
        ("100Mbit", 100_000_000),
        ("1gbit", 1_000_000_000),
        ("1.5mbit", 1_500_000),
        ("512kbit", 512_000),
        ("12.5mbps", 100_000_000),
        ("1mibit", 1024 * 1024),
        (" 10 gbit ", 10_000_000_000),
    ],
)
def test_parse_rate(text, bits):
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text", ["100", "100mb", "fast", "-5mbit", "1kbit", "1tbit", "", "10%"])
def test_parse_rate_rejects(text):
    with pytest.raises(ValueError):
        parse_rate(text)


def test_parse_time_and_loss():
    assert parse_time("10ms") == 10_000
    assert parse_time("0.5ms") == 500
    assert parse_time("250us") == 250
    assert parse_time("1s") == 1_000_000
    for bad in ("10", "0ms", "11s", "ten ms", "5min"):
        with pytest.raises(ValueError):
            parse_time(bad)
    assert parse_loss("0.1%") == 0.1
    assert parse_loss("2") == 2.0
    for bad in ("0%", "100%", "1x", "-1%"):
        with pytest.raises(ValueError):
            parse_loss(bad)


def test_format_rate_and_burst():
    assert format_rate(100_000_000) == "100mbit"
    assert format_rate(1_500_000_000) == "1.5gbit"
    assert tbf_burst_bytes(100_000_000) == 50_000
    assert tbf_burst_bytes(1_000_000) == 16 * 1024


# ---------------------------------------------------------------------------- tc commands


def test_tc_commands_all_links_tbf_only():
    shape = LinkShape.from_strings("100mbit")
    assert tc_commands(shape, "eth0") == [
        "tc qdisc add dev eth0 root handle 1: tbf rate 100000000bit burst 50000 latency 50ms".split()
    ]


def test_tc_commands_all_links_with_netem():
    shape = LinkShape.from_strings("100mbit", "10ms", "0.1%")
    commands = tc_commands(shape, "eth0")
    assert len(commands) == 2
    assert commands[0][:9] == "tc qdisc add dev eth0 root handle 1: tbf".split()
    assert (
        commands[1]
        == (
            "tc qdisc add dev eth0 parent 1:1 handle 10: netem delay 10000us loss 0.1% limit 1000"
        ).split()
    )


def test_tc_commands_netem_limit_grows_with_bdp():
    shape = LinkShape.from_strings("10gbit", "50ms")
    netem = tc_commands(shape, "eth0")[1]
    # 2 * 1.25e9 B/s * 0.05 s / 1000 B per packet.
    assert netem[netem.index("limit") + 1] == "125000"


def test_tc_commands_selected_destinations_use_htb():
    shape = LinkShape.from_strings("100mbit", "5ms")
    commands = tc_commands(shape, "eth0", {2: "10.213.9.3", 11: "10.213.9.12"})
    text = [" ".join(c) for c in commands]
    assert text[0] == "tc qdisc add dev eth0 root handle 1: htb default 1"
    assert text[1].startswith(
        "tc class add dev eth0 parent 1: classid 1:1 htb rate 100000000000bit"
    )
    assert text[2] == (
        "tc class add dev eth0 parent 1: classid 1:102 htb rate 100000000bit ceil 100000000bit "
        "quantum 200000 burst 50000 cburst 50000"
    )
    assert text[3] == (
        "tc qdisc add dev eth0 parent 1:102 handle 102: netem delay 5000us limit 1000"
    )
    assert text[4] == (
        "tc filter add dev eth0 parent 1: protocol ip prio 1 u32 match ip dst 10.213.9.3/32 "
        "flowid 1:102"
    )
    assert "classid 1:10b" in text[5] and "dst 10.213.9.12/32 flowid 1:10b" in text[7]
    assert len(commands) == 8


def test_tc_commands_nothing_to_shape():
    assert tc_commands(None, "eth0") == []
    assert tc_commands(LinkShape.from_strings("1gbit"), "eth0", {}) == []


def test_network_shaping_plan_per_scope_without_root():
    """The per-rank commands ShapedNetwork would run, for each scope (nothing is created)."""
    layout = ParallelLayout(4, tp_size=1, pp_size=2)

    net = ShapedNetwork(4, bandwidth="100mbit", shaped_pairs=None, prefix="mxnbunit")
    for rank in range(4):
        (only,) = net._shaping_commands(rank)
        assert "tbf" in only

    net = ShapedNetwork(4, bandwidth="100mbit", shaped_pairs=layout.pairs("pp"), prefix="mxnbunit")
    filters = [c for c in net._shaping_commands(0) if c[1] == "filter"]
    assert [c[c.index("dst") + 1] for c in filters] == [
        f"{net.address(2)}/32",
        f"{net.address(3)}/32",
    ]

    net = ShapedNetwork(4, bandwidth="100mbit", shaped_pairs=layout.pairs("dp"), prefix="mxnbunit")
    filters = [c for c in net._shaping_commands(3) if c[1] == "filter"]
    assert [c[c.index("dst") + 1] for c in filters] == [f"{net.address(2)}/32"]

    net = ShapedNetwork(4, bandwidth=None, prefix="mxnbunit")
    assert all(net._shaping_commands(r) == [] for r in range(4))
    assert net.shaped_pairs == frozenset()


def test_network_setup_stays_inside_namespaces():
    net = ShapedNetwork(2, bandwidth="100mbit", prefix="mxnbunit")
    for rank in range(2):
        for argv in net._setup_commands(rank):
            # Every ip command names a namespace with -n: nothing touches the root namespace.
            assert argv[:2] == ["ip", "-n"] and argv[2].startswith("mxnbunit")
    assert net.address(0).startswith("10.213.") and net.address(1).endswith(".2")
    env = net.rank_env(1, {"FOO": "bar"})
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2" and env["FOO"] == "bar"
    assert env["MASTER_ADDR"] == net.address(0) and env["GLOO_SOCKET_IFNAME"] == "eth0"
    argv = rank_command("ns", {"A": "1"}, ["python", "-c", "pass"])
    assert argv == ["ip", "netns", "exec", "ns", "env", "A=1", "python", "-c", "pass"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_ranks": 1, "bandwidth": "1gbit"},
        {"num_ranks": 2, "bandwidth": "fast"},
        {"num_ranks": 2, "bandwidth": None, "latency": "1ms"},
        {"num_ranks": 2, "bandwidth": "1gbit", "shaped_pairs": {(0, 2)}},
        {"num_ranks": 2, "bandwidth": "1gbit", "prefix": "bad-prefix"},
    ],
)
def test_network_rejects_bad_arguments(kwargs):
    num_ranks = kwargs.pop("num_ranks")
    with pytest.raises(ValueError):
        ShapedNetwork(num_ranks, **kwargs)


# ---------------------------------------------------------------------------- cli


@pytest.mark.parametrize(
    "argv",
    [
        ["--bandwidth", "100"],
        ["--latency", "10"],
        ["--nproc", "1"],
        ["--nproc", "4", "--tp", "3"],
        ["--shape", "pp", "--nproc", "2"],
        ["--shape", "xx"],
        ["--unshaped", "--latency", "1ms"],
    ],
)
def test_cli_bad_flags_exit_2_with_one_line(argv, capsys):
    assert cli.main(argv + ["--", "true"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megatron-ext netbench: error:") and "\n" not in err


def test_cli_requires_command(capsys):
    assert cli.main(["--nproc", "2"]) == 2
    assert "COMMAND" in capsys.readouterr().err
    assert cli.main(["--"]) == 2


def test_cli_refuses_without_root_or_tools(monkeypatch, capsys):
    from megatron_ext.netbench import netns

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert cli.main(["--", "true"]) == 2
    err = capsys.readouterr().err
    assert "root" in err and "sudo" in err and err.count("\n") == 1

    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "tc" else "/x")
    assert cli.main(["--", "true"]) == 2
    err = capsys.readouterr().err
    assert "'tc' not found" in err and "iproute2" in err
    assert "not found" in netns.netns_unavailable_reason()


# ---------------------------------------------------------------------------- sites


def test_sites_dp4_two_sites_shapes_only_cross_site_pairs():
    layout = ParallelLayout(4, sites=2)
    assert [layout.site(r) for r in range(4)] == [0, 0, 1, 1]
    cross = {(s, d) for s in (0, 1) for d in (2, 3)}
    assert layout.pairs("sites") == cross | {(d, s) for s, d in cross}
    assert (0, 1) not in layout.pairs("sites") and (2, 3) not in layout.pairs("sites")
    # Pure DiLoCo: one rank per site, every pair crosses.
    assert ParallelLayout(4, sites=4).pairs("sites") == ParallelLayout(4).pairs("all")
    assert ParallelLayout(4).pairs("sites") == frozenset()  # one site: nothing to shape


def test_sites_follow_dp_rank_across_tp_and_pp():
    # world 16, tp 2, pp 2 -> dp 4; rank = pp*8 + dp*2 + tp; 2 sites = dp {0,1} and {2,3}.
    layout = ParallelLayout(16, tp_size=2, pp_size=2, sites=2)
    for rank in range(16):
        c = layout.coord(rank)
        assert layout.site(rank) == c.dp_rank // 2
    site0 = {r for r in range(16) if layout.site(r) == 0}
    assert site0 == {0, 1, 2, 3, 8, 9, 10, 11}
    pairs = layout.pairs("sites")
    assert len(pairs) == 2 * 8 * 8
    assert pairs == {(s, d) for s in range(16) for d in range(16) if (s in site0) != (d in site0)}
    # In-site links of every kind stay fast: TP (0,1), DP (0,2), PP (0,8); cross-site
    # links of every kind are shaped: DP (0,4), PP (0,12), other (1,6).
    for inside in ((0, 1), (0, 2), (0, 8), (3, 10)):
        assert inside not in pairs
    for across in ((0, 4), (0, 12), (1, 6), (15, 0)):
        assert across in pairs


@pytest.mark.parametrize("world,tp,pp,sites", [(6, 1, 1, 4), (8, 2, 1, 3), (4, 1, 1, 0)])
def test_sites_must_divide_dp(world, tp, pp, sites):
    with pytest.raises(ValueError):
        ParallelLayout(world, tp_size=tp, pp_size=pp, sites=sites)


def test_sites_check_links_measure_cross_and_in_site():
    layout = ParallelLayout(4, sites=2)
    shaped, unshaped = select_check_links(4, set(layout.pairs("sites")), max_links=2)
    assert all(layout.site(s) != layout.site(d) for s, d in shaped) and len(shaped) == 2
    assert unshaped is not None and layout.site(unshaped[0]) == layout.site(unshaped[1])


def test_network_shaping_plan_sites_without_root():
    layout = ParallelLayout(4, pp_size=1, sites=2)
    net = ShapedNetwork(
        4, bandwidth="10mbit", shaped_pairs=layout.pairs("sites"), prefix="mxnbunit"
    )
    for rank, far in ((0, (2, 3)), (1, (2, 3)), (2, (0, 1)), (3, (0, 1))):
        filters = [c for c in net._shaping_commands(rank) if c[1] == "filter"]
        assert [c[c.index("dst") + 1] for c in filters] == [f"{net.address(r)}/32" for r in far]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--nproc", "4", "--shape", "sites"], "--sites"),
        (["--nproc", "4", "--sites", "2"], "--sites applies only to --shape sites"),
        (["--nproc", "4", "--shape", "dp", "--sites", "2"], "not --shape dp"),
        (["--nproc", "4", "--shape", "sites", "--sites", "1"], "--sites must be at least 2"),
        (["--nproc", "6", "--shape", "sites", "--sites", "4"], "--sites 4 does not divide"),
        (["--nproc", "4", "--tp", "2", "--shape", "sites", "--sites", "4"], "size 2"),
        (["--unshaped", "--nproc", "4", "--shape", "sites", "--sites", "2"], "--unshaped"),
    ],
)
def test_cli_sites_bad_flags_name_the_flag(argv, needle, capsys):
    assert cli.main(argv + ["--", "true"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megatron-ext netbench: error:") and "\n" not in err
    assert needle in err


def test_cli_sites_parse_builds_the_site_layout():
    args, command, layout = cli._parse(
        ["--nproc", "8", "--pp", "2", "--shape", "sites", "--sites", "2", "--", "true"]
    )
    assert command == ["true"] and layout.sites == 2 and layout.dp_size == 4
    assert layout.pairs(args.shape) == ParallelLayout(8, pp_size=2, sites=2).pairs("sites")
    assert cli._link_kind(layout, 0, 2) == "dp (site 0->1)"
    assert cli._link_kind(layout, 0, 4) == "pp (site 0)"


def test_site_jobs_shape_only_links_between_sites_without_root():
    """Separate site jobs: one namespace per site plus the lighthouse's, whose links are
    unshaped; each job gets a one-rank world's variables with its store on its address."""
    from megatron_ext.netbench import SiteJobsNetwork, site_job_pairs

    assert site_job_pairs(2) == {(0, 1), (1, 0)}
    jobs = SiteJobsNetwork(3, bandwidth="100mbit", prefix="mxnbunit")
    net = jobs.network
    assert net.num_ranks == 4 and jobs.lighthouse_host == net.address(3)
    for site in range(3):
        filters = [c for c in net._shaping_commands(site) if c[1] == "filter"]
        far = [net.address(r) + "/32" for r in range(3) if r != site]
        assert [c[c.index("dst") + 1] for c in filters] == far  # never the lighthouse
    assert net._shaping_commands(3) == []
    env = jobs.site_env(2, {"FOO": "1"})
    assert (env["RANK"], env["WORLD_SIZE"], env["FOO"]) == ("0", "1", "1")
    assert env["MASTER_ADDR"] == jobs.address(2) and env["GLOO_SOCKET_IFNAME"] == "eth0"
    with pytest.raises(ValueError):
        jobs.address(3)
    with pytest.raises(ValueError):
        SiteJobsNetwork(1, bandwidth="100mbit")
