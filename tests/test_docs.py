"""The README's code and the examples run as written (as subprocesses, with tiny sizes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "error", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stderr == "", out.stderr
    return out


def test_readme_quick_start_runs() -> None:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README.md has no python block"
    out = run(["-c", blocks[0]]).stdout
    assert re.fullmatch(r"9 rows; a batch of 256, obs \(256, 4\) on (cpu|cuda:0)\n", out), out


TEST_COMMAND = ('python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 && '
                '.venv/bin/pip install -e ".[dev]" && .venv/bin/pytest -n auto')
DEMO_COMMAND = ('python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 && '
                '.venv/bin/pip install -e ".[demo]" && .venv/bin/shmbuffer demo')


def test_readme_commands_are_the_ci_commands() -> None:
    """CI runs exactly the README's test command: extract it with .ci/run's own awk program and
    compare; the README's demo command is a block of its own."""
    ci = (ROOT / ".ci" / "run").read_text()
    program = re.search(r"cmd=\$\(awk '(.*?)' README\.md\)", ci)
    assert program, ".ci/run no longer takes its command from README.md with awk"
    assert 'eval "$cmd"' in ci
    extracted = subprocess.run(["awk", program.group(1), str(ROOT / "README.md")], capture_output=True, text=True, check=True)
    assert extracted.stdout.strip() == TEST_COMMAND
    blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)
    assert DEMO_COMMAND in blocks and TEST_COMMAND in blocks


EXAMPLES = {  # tiny sizes; --target 0: a run this short learns nothing, and says so in its exit status
    "quickstart.py": ["--capacity", "1000", "--seconds", "1"],
    "r2d2.py": ["--updates", "20", "--capacity", "4000", "--learning-starts", "200", "--target", "0"],
    "ppg_buffers.py": ["--iterations", "2", "--aux-every", "2", "--rollout", "32", "--target", "0"],
    "expert_mix.py": ["--demos", "2", "--updates", "50", "--target", "0"],
    "her_bit_flipping.py": ["--n-bits", "4", "--capacity", "2000", "--learning-starts", "50", "--max-updates", "20",
                            "--eval-every", "10", "--eval-episodes", "2", "--target", "0"],
}
RESULT = {  # the one line each example ends with
    "quickstart.py": r"OK: 2 workers pushed [\d,]+ rows \([\d,]+ rows/s\) in [\d.]+ s; the learner sampled [\d,]+ batches",
    "r2d2.py": r"LEARNED: mean return of the last 20 episodes [\d.]+ \(the first 20: [\d.]+; target 0\), 20 updates",
    "ppg_buffers.py": r"LEARNING: mean episode return [\d.]+ in iteration 1, [\d.]+ in iteration 2 \(target 0\)",
    "expert_mix.py": r"IMITATED: greedy return [\d.]+ over 5 episodes after 50 updates \(target 0;",
    "her_bit_flipping.py": r"SOLVED: greedy success rate [\d.]+ over 2 episodes after 10 updates, [\d.]+ s \(target 0; "
                           r"2 collector processes made [\d,]+ env steps\)",
}


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_example_runs(example: str) -> None:
    out = run([str(ROOT / "examples" / example), *EXAMPLES[example]])
    assert re.match(RESULT[example], out.stdout.strip().splitlines()[-1]), out.stdout


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.py")))
def test_example_flags_say_their_defaults(example: str) -> None:
    text = run([str(ROOT / "examples" / example), "--help"]).stdout
    flags = re.findall(r"^  (--[a-z-]+)", text, flags=re.M)
    defaults = re.findall(r"\(default:\s", text)  # argparse may wrap the line inside it
    assert len(flags) >= 3 and len(defaults) == len(flags), text  # every flag: help and its default
    assert re.search(r"What a run at the\s+defaults show", text)  # what it prints, in its docstring


def test_an_example_that_falls_short_exits_non_zero() -> None:
    env = {**os.environ, "PYTHONWARNINGS": "error", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "ppg_buffers.py"), "--iterations", "1",
                          "--rollout", "16", "--target", "1000"], capture_output=True, text=True, timeout=240,
                         env=env, cwd=ROOT)
    assert out.returncode == 1 and out.stdout.strip().splitlines()[-1].startswith("NOT LEARNING:"), out.stdout + out.stderr


ELSEWHERE = {"atari.py": "test_atari_example.py", "ray_cluster.py": "test_ray.py",
             "cleanrl_dqn_vector.py": "test_vector.py", "torchrl_collector.py": "test_torchrl.py",
             "envpool_dqn.py": "test_vector_envpool.py", "ddp_dqn.py": "test_ranks.py"}
"""Examples that need an extra (ale-py, Ray, TorchRL, EnvPool) or belong to a module's tests (torchrun:
test_ranks.py), smoke-tested there."""


def test_every_example_is_smoke_tested() -> None:
    assert sorted(p.name for p in (ROOT / "examples").glob("*.py")) == sorted([*EXAMPLES, *ELSEWHERE])
    for example, test in ELSEWHERE.items():
        assert f'"{example}"' in (ROOT / "tests" / test).read_text(), (example, test)


def test_the_demo_command_runs() -> None:
    """``shmbuffer demo`` end to end with tiny settings (learning itself is measured, not tested:
    see the README), through the installed command's code path."""
    env = {**os.environ, "PYTHONWARNINGS": "error", "PYTHONPATH": str(ROOT)}
    args = ["--max-seconds", "3", "--learning-starts", "300", "--eval-every", "50", "--eval-episodes", "2",
            "--capacity", "4000", "--target", "1000"]
    out = subprocess.run([sys.executable, "-m", "shmbuffer.cli", "demo", *args], capture_output=True, text=True,
                         timeout=240, env=env, cwd=ROOT)
    assert out.returncode == 1, out.stdout + out.stderr  # a target of 1000 cannot be reached: exit 1
    assert out.stderr == "", out.stderr
    assert "NOT LEARNED: mean evaluation return" in out.stdout and "2 collector processes" in out.stdout
    help_text = subprocess.run([sys.executable, "-m", "shmbuffer.cli", "demo", "--help"], capture_output=True,
                               text=True, timeout=60, env=env, cwd=ROOT)
    assert "--samples-per-insert" in help_text.stdout
