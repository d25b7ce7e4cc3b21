"""Every command README.md and the docs/ pages show, run as written (with faster settings appended where it
measures something), so that the documentation cannot drift from the command line again; and every relative link
in them (and in demo/README.md) resolves. Synopses (options in brackets, PLACEHOLDERS) are left out; training
recipes and the GPU check are only parsed or located (they take tens of minutes or a GPU); a profile of a big
random shape is only parsed (it builds a model of billions of parameters), unless it only estimates memory.
Commands joined by ``&&`` run in order in one folder (a ``decode`` reads what the ``generate`` before it wrote)."""
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fastar.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")  # PATH, MODEL, N, KL_VAE ...
ONLY_PARSED = ("train-drafter", "distill-dd")
# a benchmark takes a minute even at FASTER's settings, and each of its modes runs in its own test (test_cli,
# test_mar_cli, test_dd, test_demo_var): here a bench command is parsed and the files it names must exist, but for
# the speed dial's (--dial), which no other test runs; a profile with LlamaGen's own code needs a checkout the tests
# never fetch (test_loop_baselines runs it where FASTAR_LLAMAGEN_CODE names one)
RUN_ELSEWHERE = {"bench": lambda argv: "--dial" not in argv, "profile": lambda argv: "--llamagen-code" in argv}
SMALL_SHAPES = ("tiny", "demo")
FASTER = {  # appended: argparse keeps the last value of an option
    "bench": ["--samples", "2", "--sweep-samples", "1", "--timing-runs", "1", "--toy-rows", "200", "--no-pareto",
              "--num-iter", "8", "--mar-steps", "8", "--diffusion-steps", "5"],
    "profile": ["--repeats", "1", "--windows", "1", "--batches", "1"],
}
# README's one command per bundled model family: the model each must name (None: the default class demo)
FAMILIES = {"class": None, "text": "demo/demo_text", "MAR": "demo/demo_mar.safetensors",
            "VAR": "demo/demo_var.safetensors", "DD": "demo/demo_dd.safetensors",
            "VAR-DD": "demo/demo_var_dd.safetensors"}


def chains(text: str) -> list[tuple[str, ...]]:
    """What follows ``-m fastar`` in every command of a page, a line's commands joined by ``&&`` kept together: in
    code blocks, then in inline code."""
    found = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            found.append(tuple(part.split("-m fastar", 1)[1].strip()
                               for part in line.split("&&") if "-m fastar" in part))
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for inline in re.findall(r"`([^`]*?-m fastar[^`]*)`", prose):
        parts = " ".join(inline.split()).split("&&")
        found.append(tuple(part.split("-m fastar", 1)[1].strip() for part in parts if "-m fastar" in part))
    return [chain for chain in found if chain]


def is_concrete(command: str) -> bool:
    return not any("[" in t or "|" in t or "..." in t or PLACEHOLDER.match(t) for t in shlex.split(command))


def named_in_passing(command: str, commands: set[str]) -> bool:
    """``python -m fastar bench`` alone in prose, where the docs also show a bench command in full (or nothing:
    ``python -m fastar``)."""
    return len(command.split()) <= 1 and any(c.split()[:1] == command.split() and c != command for c in commands)


def documented() -> dict[tuple[str, ...], str]:
    """Every concrete chain of every page (the first page that shows it) -> the page's name."""
    by_page = {page: [c for c in chains(page.read_text()) if all(is_concrete(part) for part in c)] for page in PAGES}
    every = {command for found in by_page.values() for chain in found for command in chain}
    runs = {}
    for page, found in by_page.items():
        for chain in found:
            if not (len(chain) == 1 and named_in_passing(chain[0], every)) and chain != ("",):
                runs.setdefault(chain, page.name)
    return runs


RUNS = documented()
README_COMMANDS = [c for chain in chains(README.read_text()) for c in chain if is_concrete(c)]


def option(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_readme_has_a_command_per_bundled_family():
    generates = [shlex.split(c) for c in README_COMMANDS if c.startswith("generate ")]
    for family, model in FAMILIES.items():
        runs = [argv for argv in generates if option(argv, "--model") == model and option(argv, "--out")]
        assert runs, f"README shows no generate command with --out for the {family} demo ({model or 'default'})"
    text = README.read_text()
    for command in ("bash tools/comfyui/demo.sh", "bash tools/run_tests.sh", "bash tools/setup_env.sh"):
        assert re.search(rf"```bash\n[^`]*^{re.escape(command)}$", text, re.M), command


def test_the_docs_have_the_commands_this_test_runs():
    subcommands = {shlex.split(c)[0] for chain in RUNS for c in chain}
    assert {"generate", "decode", "bench", "profile", "quantize"} <= subcommands, subcommands
    assert len(RUNS) >= 20, RUNS


@pytest.mark.parametrize("chain", list(RUNS),
                         ids=lambda chain: f"{RUNS[chain]}: " + " ".join(shlex.split(chain[0])[:3]))
def test_a_documented_command_runs_as_written(chain, tmp_path):
    (tmp_path / "demo").symlink_to(ROOT / "demo")  # the docs' paths are relative to the repository root
    for command in chain:
        run(shlex.split(command), tmp_path)


def run(argv: list[str], cwd: Path) -> None:
    if argv[0].startswith("."):  # python -m fastar.PACKAGE.NAME: a demo recipe or the GPU check
        assert (ROOT / Path(*argv[0].lstrip(".").split("."))).with_suffix(".py").is_file(), argv[0]
        return
    if "--help" in argv:
        r = subprocess.run([sys.executable, "-m", "fastar", *argv], cwd=cwd, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0 and "usage:" in r.stdout, r.stderr[-3000:]
        return
    build_parser().parse_args(argv)  # every option exists, every required one is there
    big_shape = (argv[0] == "profile" and option(argv, "--shape") not in (None, *SMALL_SHAPES)
                 and "--memory" not in argv)
    if argv[0] in ONLY_PARSED or big_shape:
        return
    if RUN_ELSEWHERE.get(argv[0], lambda _: False)(argv):
        named = [cwd / a for a in argv if a.startswith("demo/")]
        assert all(path.exists() for path in named), [str(p) for p in named if not p.exists()]
        return
    faster = [] if "--memory" in argv else FASTER.get(argv[0], [])
    r = subprocess.run([sys.executable, "-m", "fastar", *argv, *faster], cwd=cwd, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    if argv[0] in ("generate", "decode"):
        out = option(argv, "--out")
        if out is None:
            assert list(cwd.glob("out/*.png")), f"{argv[0]} wrote no image"
        else:
            path = cwd / out
            assert path.is_file() or path.with_name(f"{path.stem}_0{path.suffix}").is_file(), f"no image at {out}"


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", [*PAGES, ROOT / "demo" / "README.md"],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: {target} does not exist"
        if anchor and file.suffix == ".md":
            assert anchor in anchors(file), f"{page.name}: {target}: no such heading in {file.name}"


def test_readme_links_every_docs_page():
    linked = set(re.findall(r"\]\(docs/([^)#]+\.md)", README.read_text()))
    assert {p.name for p in PAGES if p != README} <= linked
