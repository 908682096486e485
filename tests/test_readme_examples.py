"""Issue 20 item 5: the README's Python runs as written.  Every ```python block of README.md
is an example marked ``<!-- example: NAME -->`` (or ``<!-- example: NAME after PREV -->``,
run in the namespace PREV's chain left) on the line before it; each chain runs in a fresh
interpreter, on the CPU, on this leg's backend (KVCM_BACKEND), in a scratch directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from children import child_env

# the checkout these tests are in (not the installed kvcm's: a `pip install '.[vllm]'` over an
# editable install puts kvcm in site-packages, where no README.md is)
README = Path(__file__).resolve().parent.parent / "README.md"
MARK = re.compile(r"^<!-- example: ([\w-]+)(?: after ([\w-]+))?(?: needs (vllm))? -->$")
FENCE = re.compile(r"^```(\w*)\s*$")


def examples(text: str) -> dict[str, tuple[str | None, str, int, str | None]]:
    """``{name: (after, code, line, needs)}`` (``needs``: ``"vllm"`` for an example that runs
    in the vllm leg, tests/test_vllm_connector.py, else None); raises AssertionError for an unmarked python block,
    a marker without a python block, or a chain to an unknown example."""
    lines = text.splitlines()
    out: dict[str, tuple[str | None, str, int, str | None]] = {}
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        lang, start = m.group(1), i
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            i += 1
        body = "\n".join(lines[start + 1 : i]) + "\n"
        i += 1
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mark = MARK.match(prev.strip())
        if lang == "python":
            assert mark, f"README.md:{start + 1}: a python block without an <!-- example: NAME --> marker"
            name, after, needs = mark.group(1), mark.group(2), mark.group(3)
            assert name not in out, f"README.md:{start + 1}: example {name!r} twice"
            assert after is None or after in out, f"README.md:{start + 1}: {name!r} after unknown {after!r}"
            out[name] = (after, body, start + 1, needs)
        else:
            assert mark is None, f"README.md:{start + 1}: an example marker on a {lang or 'plain'} block"
    return out


EXAMPLES = examples(README.read_text(encoding="utf-8"))


def chain(name: str) -> list[str]:
    after = EXAMPLES[name][0]
    return ([*chain(after)] if after else []) + [name]


def test_readme_has_examples_and_the_parser_refuses_unmarked_blocks():
    assert {"engine-loop", "copy-error", "decode-batch", "publisher", "shared-tier", "quota"} <= set(EXAMPLES)
    assert EXAMPLES["vllm-llm"][3] == "vllm"  # run by tests/test_vllm_connector.py in the vllm leg
    with pytest.raises(AssertionError, match="without an <!-- example"):
        examples("text\n```python\nprint(1)\n```\n")


# argv: NAME PATH pairs, then "--" and the arguments the examples see as sys.argv[1:]
RUNNER = """
import sys
sep = sys.argv.index("--")
pairs, sys.argv = sys.argv[1:sep], [sys.argv[0], *sys.argv[sep + 1:]]
ns = {"__name__": "__main__"}
for name, path in zip(pairs[0::2], pairs[1::2]):
    print(f"== {name}", flush=True)
    exec(compile(open(path).read(), f"README.md example {name}", "exec"), ns)
"""


def run_example(name: str, tmp_path: Path, argv: tuple[str, ...] = (), timeout: float = 300) -> str:
    """Run example ``name`` (after its chain) in a fresh interpreter; its stdout."""
    args = []
    for n in chain(name):
        path = tmp_path / f"{n}.py"
        path.write_text(EXAMPLES[n][1])
        args += [n, str(path)]
    env = child_env({k: v for k, v in os.environ.items() if k != "KVCM_OPLOG"})  # the kvcm this process runs
    p = subprocess.run([sys.executable, "-c", RUNNER, *args, "--", *argv], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=timeout, check=False)
    assert p.returncode == 0, f"README.md:{EXAMPLES[name][2]} ({name}):\n{p.stdout}\n{p.stderr}"
    return p.stdout


@pytest.mark.parametrize("name", sorted(n for n, e in EXAMPLES.items() if e[3] is None))
def test_readme_example_runs_as_written(name, tmp_path):
    out = run_example(name, tmp_path)
    if "engine-loop" in chain(name):
        assert "\n96\n" in out, out  # the system prompt is reusable: chunked commits snapshot the ssm state
    if name == "transformers-chat":  # exactness is asserted inside; kvcm must also have served a prefix
        m = re.search(r"prompt tokens (\d+): (\d+) reused from kvcm, (\d+) computed", out)
        assert m and int(m.group(2)) > 0 and int(m.group(1)) == int(m.group(2)) + int(m.group(3)), out
    if name == "shared-tier":
        assert "first reuses 0 tokens" in out and "second reuses 320 tokens" in out, out
        assert "first would load []" in out and "second would load [3]" in out, out
