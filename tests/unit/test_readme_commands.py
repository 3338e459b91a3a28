"""The shell commands of ``README.md``, ``docs/`` and ``patches/README.md``, checked without training.

Every ``bash`` block is split into commands (continuation lines joined, ``&&`` chains and
comments split off). Then, cheaply (no process is started, nothing trains):

* each ``torchrun ... -m megatron_ext.train`` command is parsed and validated exactly as the
  driver does before it starts (flags, run-file and model presets, the parallel layout for
  its ``--nproc-per-node``, method/layout combinations): a renamed flag, a bad value or a
  refused combination in the README fails here;
* each Megatron-LM command (zero-touch ``-m megatron_ext pretrain``, a patched
  ``pretrain_gpt.py``) uses only flags that Megatron-LM's parser at a supported tag has
  (``tests/data/megatron_lm_<tag>_flags.txt``) or that megatron-ext adds to it, and the
  launcher options (``--cpu``) where the launcher reads them;
* ``megatron-ext`` subcommands exist, ``pip install`` extras exist in ``setup.py``, and the
  files and environment variables the commands name exist or are read by the scripts.

The two long commands (the first training run and the test suite) are what CI runs anyway;
``.ci/run`` must run exactly the README's test command. Every relative link of these files
(and of the reports under ``docs/``) must name a file that exists and, with ``#anchor``, a
heading of it.
"""

import re
import shlex
from pathlib import Path
from typing import List, Tuple

import pytest

from tests.helpers.paths import REPO

DOCS = [REPO / "README.md", REPO / "patches" / "README.md"] + sorted((REPO / "docs").rglob("*.md"))
_BLOCK = re.compile(r"```bash\n(.*?)```", re.S)


GPU_SECTION = "On a GPU"
"""The section (of any of the files) whose commands run on a GPU: the only ones allowed
without --cpu (``docs/performance/README.md`` has it)."""


def _commands(path: Path) -> List[Tuple[str, List[str]]]:
    """(the command's text, its words) for every command of every bash block of ``path``."""
    out = []
    for block in _BLOCK.findall(path.read_text(encoding="utf-8")):
        out += _block_commands(block)
    return out


def _gpu_commands() -> List[str]:
    """The texts of the commands in the GPU sections of the files."""
    out = []
    for path in DOCS:
        for section in path.read_text(encoding="utf-8").split(f"\n## {GPU_SECTION}\n")[1:]:
            section = section.split("\n## ", 1)[0]
            out += [t for block in _BLOCK.findall(section) for t, _ in _block_commands(block)]
    return out


def _block_commands(block: str) -> List[Tuple[str, List[str]]]:
    """(the command's text, its words) for every command of one bash block."""
    out = []
    lines, joined = [], ""
    for raw in block.splitlines():
        line = raw.split("  #")[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if line.endswith("\\"):
            joined += line[:-1] + " "
            continue
        joined += line
        if joined.strip():
            lines.append(joined.strip())
        joined = ""
    for line in lines:
        for part in line.split(" && "):
            words = shlex.split(part.replace("<", "'<").replace(">", ">'"))
            out.append((part, words))
    return out


ALL = [
    (str(path.relative_to(REPO)), text, words) for path in DOCS for text, words in _commands(path)
]


def _env_and_rest(words: List[str]) -> Tuple[dict, List[str]]:
    env, i = {}, 0
    while i < len(words) and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[i]):
        key, value = words[i].split("=", 1)
        env[key] = value
        i += 1
    return env, words[i:]


def test_the_docs_have_the_commands_this_test_checks():
    kinds = [" ".join(w) for _, _, w in ALL]
    assert sum("megatron_ext.train" in k for k in kinds) >= 5, kinds
    assert any("megatron_ext pretrain" in " ".join(w) for _, _, w in ALL)
    assert any(w and w[0] == "MEGATRON_EXT_CPU=1" for _, _, w in ALL)
    assert _gpu_commands(), f"no '## {GPU_SECTION}' section with commands"
    methods = [p.stem for p in (REPO / "docs" / "methods").glob("*.md")]
    for stem in methods:  # every method page shows a command that this test checks
        if stem != "dp-compression":
            assert any(n == f"docs/methods/{stem}.md" for n, _, _ in ALL), stem


def test_readme_is_short_and_links_every_docs_page():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200, "the README is at most 200 lines: move text to docs/"
    for page in (REPO / "docs" / "methods").glob("*.md"):
        assert f"](docs/methods/{page.name})" in text, page.name
    index = (REPO / "docs" / "README.md").read_text(encoding="utf-8")
    for page in (REPO / "docs").glob("*.md"):
        if page.name != "README.md":
            assert f"]({page.name}" in index, f"docs/README.md does not link {page.name}"


def _readme_block_lines() -> List[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    return [line for block in _BLOCK.findall(text) for line in block.splitlines() if line]


def test_ci_runs_exactly_the_readme_test_command():
    """The README's test command is the last line of ``.ci/run``, character for character."""
    ci = [l for l in (REPO / ".ci" / "run").read_text().splitlines() if l.strip()]
    readme = _readme_block_lines()
    tests = [l for l in readme if "python -m pytest" in l]
    assert tests == [ci[-1]], (tests, ci[-1])
    for path in DOCS:  # a copy of the test command elsewhere is the same command
        blocks = _BLOCK.findall(path.read_text(encoding="utf-8"))
        copies = [l for b in blocks for l in b.splitlines() if l.startswith("python3 -m venv")]
        assert all(l == ci[-1] for l in copies if "pytest" in l), path
    first = [l for l in readme if "-m megatron_ext.train" in l]
    assert first and first[0].startswith("python3 -m venv .venv && "), first


def _torchrun(words: List[str]) -> Tuple[int, List[str]]:
    if words[:3] == ["python", "-m", "megatron_ext.train"]:
        return 1, words[1:]  # one process, no torchrun
    if words[:2] == ["megatron-ext", "netbench"]:  # netbench starts --nproc ranks of COMMAND
        from megatron_ext.netbench.cli import _parse

        args, command, _ = _parse(words[2:])
        assert command[0] == "python", words
        return args.nproc, command[1:]
    assert words[0] == "torchrun", words
    nproc = int(words[words.index("--nproc-per-node") + 1])
    return nproc, words[words.index("--nproc-per-node") + 2 :]


_DRIVER = [(n, t, w) for n, t, w in ALL if "megatron_ext.train" in w]


@pytest.mark.parametrize(
    "name, text, words", _DRIVER, ids=[f"{n}:{' '.join(w[5:9])}" for n, _, w in _DRIVER]
)
def test_driver_commands_parse_and_validate_for_their_layout(name, text, words, monkeypatch):
    from megatron_ext.config import validate_ext_config
    from megatron_ext.train import parse_args
    from megatron_ext.train_config import driver_layout, layout_sizes

    monkeypatch.chdir(REPO)
    nproc, rest = _torchrun(_env_and_rest(words)[1])
    assert rest[:2] == ["-m", "megatron_ext.train"], text
    cfg = parse_args(rest[2:])
    # The layout the driver itself validates against before training.
    validate_ext_config(cfg.ext, driver_layout(cfg, layout_sizes(cfg, nproc)))
    if text not in _gpu_commands():
        assert cfg.training.cpu, f"{name}: a laptop command without --cpu: {text}"
    env, rest = _env_and_rest(words)
    if rest[:2] == ["megatron-ext", "netbench"] and "sites" in rest[: rest.index("--")]:
        # Shaping the links between sites is what DiLoCo is measured with: the example trains
        # with one DiLoCo group per shaped site (not dense data parallelism).
        sites = int(rest[rest.index("--sites") + 1])
        groups = cfg.ext.summary()["outer_groups"]
        assert cfg.ext.method("outer") == "diloco" and groups == sites, text


def _saved_and_loaded(words: List[str]) -> Tuple[List[str], List[str]]:
    """(--save, --load) directories of a driver command."""
    out: Tuple[List[str], List[str]] = ([], [])
    for k, flag in enumerate(("--save", "--load")):
        if flag in words:
            out[k].append(words[words.index(flag) + 1])
    return out


def _model_of(words: List[str]) -> str:
    return words[words.index("--model") + 1] if "--model" in words else "gpt-tiny"


def test_every_loaded_checkpoint_and_data_prefix_is_made_by_an_earlier_command():
    """A ``--load DIR`` of a command is the ``--save DIR`` of a command before it in the
    same file (of the same model, with the same pipeline split), and a ``--data-path`` is
    a file of the repository or the ``--output-prefix`` of an earlier ``prepare-data``: the
    commands of a page run in order as written."""
    by_file: dict = {}
    for name, text, words in ALL:
        by_file.setdefault(name, []).append(words)
    checked = 0
    for name, commands in by_file.items():
        saved: dict = {}
        prefixes = set()
        for words in commands:
            if words[:2] == ["megatron-ext", "prepare-data"]:
                prefixes.add(words[words.index("--output-prefix") + 1])
            if "megatron_ext.train" not in words:
                continue
            pp = (
                words[words.index("--pipeline-model-parallel-size") + 1]
                if ("--pipeline-model-parallel-size" in words)
                else "1"
            )
            save, load = _saved_and_loaded(words)
            for directory in load:
                assert directory in saved, f"{name}: nothing before it saves {directory}: {words}"
                assert saved[directory] == (_model_of(words), pp), (name, directory)
                checked += 1
            if "--data-path" in words:
                prefix = words[words.index("--data-path") + 1]
                assert prefix in prefixes or (REPO / f"{prefix}.bin").exists(), (name, prefix)
            for directory in save:
                saved[directory] = (_model_of(words), pp)
    assert checked >= 1  # the AQ-SGD page's fine-tuning loads the run its first command saves


def _benchmark_parser(script: str):
    import importlib

    module = importlib.import_module(f"benchmarks.{Path(script).stem}")
    return getattr(module, "build_parser", None)


def test_benchmark_commands_parse(capsys):
    """Each ``python benchmarks/X.py ...`` of the docs is accepted by that script's parser
    (the scripts with one; the long runs are not started here)."""
    checked = 0
    parsers: dict = {}
    for name, text, words in ALL:
        rest = _env_and_rest(words)[1]
        if len(rest) < 2 or rest[0] not in ("python", "python3"):
            continue
        if not rest[1].startswith("benchmarks/"):
            continue
        if rest[1] not in parsers:
            parsers[rest[1]] = _benchmark_parser(rest[1])
        if parsers[rest[1]] is None:
            continue
        args = [re.sub(r"<[^>]*>", "PLACEHOLDER", a) for a in rest[2:]]
        try:
            parsers[rest[1]]().parse_args(args)
        except SystemExit:
            pytest.fail(f"{name}: {text}: {capsys.readouterr().err.strip()}")
        checked += 1
    assert checked >= 10, checked


def _megatron_lm_flags() -> set:
    import argparse

    from megatron_ext.megatron.lm import megatron_lm_extra_args

    flags = set()
    for path in (REPO / "tests" / "data").glob("megatron_lm_*_flags.txt"):
        flags |= {f for f in path.read_text().split() if f.startswith("--")}
    parser = megatron_lm_extra_args(None)(argparse.ArgumentParser())
    flags |= {s for a in parser._actions for s in a.option_strings}
    return flags


def test_megatron_lm_commands_use_flags_megatron_lm_or_megatron_ext_has():
    from megatron_ext.megatron.lm.launcher import parse_launcher_args

    known = _megatron_lm_flags()
    checked = 0
    for _, text, words in ALL:
        env, rest = _env_and_rest(words)
        if not rest or rest[0] != "torchrun" or "megatron_ext.train" in rest:
            continue
        _, rest = _torchrun(rest)
        if rest[:3] == ["-m", "megatron_ext", "pretrain"]:
            options, script, args = parse_launcher_args(rest[3:])
            assert options["cpu"] or "MEGATRON_EXT_CPU" not in env, text
        else:
            script, args = rest[0], rest[1:]
        assert script.endswith("pretrain_gpt.py"), text
        unknown = [a for a in args if a.startswith("--") and a.split("=")[0] not in known]
        assert not unknown, (text, unknown)
        if "--distributed-backend" in args:  # a CPU command: switched on, with its flags
            from megatron_ext.megatron.lm.cpu import CPU_REQUIRED_FLAGS

            assert options["cpu"] if rest[0] == "-m" else env.get("MEGATRON_EXT_CPU") == "1"
            for flag, _, _ in CPU_REQUIRED_FLAGS:
                assert flag.split()[0] in args, (text, flag)
        checked += 1
    assert checked >= 4, checked


def _setup_extras() -> set:
    text = (REPO / "setup.py").read_text()
    block = text[text.index("extras_require") :]
    block = block[: block.index("},") + 1]
    # "name": [...] or "name": _A_LIST
    return set(re.findall(r'^\s*"([a-z0-9-]+)": (?:\[|_[A-Z_]+)', block, re.M))


def test_pip_extras_megatron_ext_subcommands_and_named_files_exist():
    from megatron_ext.cli import SUBCOMMANDS

    extras = _setup_extras()
    assert {"test", "hf", "megatron-lm", "report"} <= extras, extras
    script_vars = (REPO / "scripts" / "pretrain_gpt_ext.sh").read_text()
    for name, text, words in ALL:
        env, rest = _env_and_rest(words)
        if rest[:2] == ["pip", "install"]:
            for word in rest[2:]:
                found = re.fullmatch(r"\.\[([a-z0-9,-]+)\]", word)
                if found:
                    assert set(found.group(1).split(",")) <= extras, (name, text)
        if rest and rest[0] == "megatron-ext":
            assert rest[1] in SUBCOMMANDS, (name, text)
        for word in words:
            value = word.split("=", 1)[-1]
            if re.match(r"(scripts|configs|benchmarks|examples|patches)/", value):
                assert (REPO / value.split(":")[0]).exists(), (name, text, value)
        if rest and rest[0].endswith("pretrain_gpt_ext.sh"):
            for key in env:
                assert re.search(rf"\b{key}\b", script_vars), (text, key)


_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"```.*?```", re.S)


def _anchors(path: Path) -> set:
    """GitHub's anchors of the headings of ``path`` (and explicit ``<a id=...>``)."""
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    out, seen = set(re.findall(r'<a id="([^"]+)"', text)), {}
    for title in re.findall(r"^#+ (.*)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_relative_links_resolve():
    broken = []
    for path in DOCS:
        text = _FENCE.sub("", path.read_text(encoding="utf-8"))
        for target in _LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.relative_to(REPO)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{path.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, broken


_DOC_PATH = re.compile(r"(?<![\w/.-])docs/\w[\w./-]*\.md")

_PAPERS = r"(?:aq-sgd|grass|protocol-models|radius|separate|diloco|streaming-diloco|sparseloco)"
_UNSHIPPED = re.compile(
    # the papers' text files, or any .txt cited for an algorithm, section, table...
    r"(?<![\w/.-])" + _PAPERS + r"\.txt\b"
    r"|\b[\w-]+\.txt,? (?:Algorithm|Alg\.|Section|Sec\.|Table|Figure|Fig\.|Eq|Appendix)"
    # the design notes, and the folder they live in
    r"|(?<![\w/.-])(?:methods|style|megatron-hooks)\.md\b|\.\./shared/|/work/shared"
    # the project's issue numbers (an upstream one names its project: Megatron-LM issue #N)
    r"|(?<!Megatron-LM )\b[Ii]ssues? #?\d+"
)
"""Citations of files that do not ship with the project (or of its issue tracker)."""


def test_doc_paths_cited_by_the_code_exist():
    """Every ``docs/...md`` a module, config, script, benchmark or test cites exists, and no
    file cites what does not ship: the papers' text files, the design notes outside the
    repository (``../shared/``, ``methods.md``, ``style.md``...) or issue numbers."""
    broken = []
    for folder, patterns in (
        ("megatron_ext", ("*.py",)),
        ("configs", ("*.yaml", "*.sh")),
        ("scripts", ("*.py", "*.sh")),
        ("benchmarks", ("*.py", "*.sh")),
        ("examples", ("*.py",)),
        ("tests", ("*.py",)),
    ):
        for pattern in patterns:
            for path in (REPO / folder).rglob(pattern):
                text = path.read_text(encoding="utf-8")
                for cited in set(_DOC_PATH.findall(text)):
                    if not (REPO / cited).is_file():
                        broken.append(f"{path.relative_to(REPO)}: {cited}")
                if path.name != "test_readme_commands.py":
                    for cited in sorted(set(_UNSHIPPED.findall(text))):
                        broken.append(f"{path.relative_to(REPO)}: cites {cited!r}")
    assert not broken, broken


def test_unshipped_citations_are_recognized():
    """The citations the test above refuses, and what it lets through."""
    for bad in [
        "What it does (aq-sgd.txt Algorithm 1; methods.md section 4):",
        "Radius (radius.txt, Algorithm 2) picks",
        "see ../shared/design/style.md",
        "a bound (paper.txt Section 3.2)",
        "(issue 26)",
        '"""Issue 25: a step',
        "(issues 25 and 26)",
        "megatron-hooks.md, fact 2",
    ]:
        assert _UNSHIPPED.search(bad), bad
    for good in [
        "``docs/methods/aqsgd.md``",
        "<save>/latest_checkpointed_iteration.txt",
        "a merges.txt file",
        "``.txt``/``.json`` files",
        "Megatron-LM issue #1138",
        "the collectives megatron-core issues, so",
        "docs/methods-notes.md",
    ]:
        assert not _UNSHIPPED.search(good), good
