"""Every command README shows, run as written (with faster settings appended where it measures something), so
that the README cannot drift from the command line again. Synopses (options in brackets, PLACEHOLDERS) are left
out; training recipes and the GPU check are only parsed (they take tens of minutes or a GPU); a profile of a big
random shape is only parsed (it builds a model of billions of parameters)."""
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fastar.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")  # PATH, MODEL, N, KL_VAE ...
ONLY_PARSED = ("train-drafter", "distill-dd")
SMALL_SHAPES = ("tiny", "demo")
FASTER = {  # appended: argparse keeps the last value of an option
    "bench": ["--samples", "2", "--sweep-samples", "1", "--timing-runs", "1", "--toy-rows", "200", "--no-pareto",
              "--num-iter", "8", "--mar-steps", "8", "--diffusion-steps", "5"],
    "profile": ["--repeats", "1", "--windows", "1", "--batches", "1"],
}


def readme_commands() -> list[str]:
    """What follows ``-m fastar`` in every command of README: in code blocks, then in inline code."""
    text = (ROOT / "README.md").read_text()
    found = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            found += [part.split("-m fastar", 1)[1] for part in line.split("&&") if "-m fastar" in part]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for inline in re.findall(r"`([^`]*?-m fastar[^`]*)`", prose):
        found += [part.split("-m fastar", 1)[1] for part in " ".join(inline.split()).split("&&")]
    return list(dict.fromkeys(c.strip() for c in found))


def is_concrete(command: str) -> bool:
    return not any("[" in t or "|" in t or "..." in t or PLACEHOLDER.match(t) for t in shlex.split(command))


def named_in_passing(command: str, commands: list[str]) -> bool:
    """``python -m fastar bench`` alone in prose, where README also shows a bench command in full (or nothing:
    ``python -m fastar``)."""
    return len(command.split()) <= 1 and any(c.split()[:1] == command.split() and c != command for c in commands)


CONCRETE = [c for c in readme_commands() if is_concrete(c)]
COMMANDS = [c for c in CONCRETE if c and not named_in_passing(c, CONCRETE)]


def test_readme_has_the_commands_this_test_runs():
    subcommands = {shlex.split(c)[0] for c in COMMANDS}
    assert {"generate", "bench", "profile"} <= subcommands and len(COMMANDS) >= 10, COMMANDS


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(shlex.split(c)[:3]))
def test_a_readme_command_runs_as_written(command, tmp_path):
    argv = shlex.split(command)
    if argv[0].startswith("."):  # python -m fastar.PACKAGE.NAME: a demo recipe or the GPU check
        assert (ROOT / Path(*argv[0].lstrip(".").split("."))).with_suffix(".py").is_file(), argv[0]
        return
    build_parser().parse_args(argv)  # every option exists, every required one is there
    big_shape = argv[0] == "profile" and "--shape" in argv and argv[argv.index("--shape") + 1] not in SMALL_SHAPES
    if argv[0] in ONLY_PARSED or big_shape:
        return
    (tmp_path / "demo").symlink_to(ROOT / "demo")  # README's paths are relative to the repository root
    r = subprocess.run([sys.executable, "-m", "fastar", *argv, *FASTER.get(argv[0], [])],
                       cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    if argv[0] == "generate":
        assert list(tmp_path.glob("out/*.png")), "generate wrote no image"
