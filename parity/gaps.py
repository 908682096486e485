"""pytest plugin: known backend gaps are data (``parity/gaps.toml``), not code (SPEC sec. 13).

Each entry::

    [[gap]]
    scenario = "test_orphan_reattach_pure_ssm"   # the test function's name
    backend  = "cpp"                             # "cpp" | "python"
    reason   = "radix tree re-attachment not ported yet"
    issue    = 3                                 # tracking issue number
    raises   = "NotImplementedError"             # optional; default "AssertionError"; may be a list
    where    = "parity"                          # optional; "parity" (default) or "tests"

marks every collected test of that name in ``parity/`` (or ``tests/``) whose ``backend``
parameter equals ``backend`` as ``xfail(strict=True, raises=<raises>)``.  So:

1. a failure of an unlisted test fails the run (nothing else is marked);
2. a listed gap that passes fails the run (strict XPASS: "gap fixed → remove its entry");
3. an entry that matches no collected test fails the run — checked only when the entry's
   whole directory was collected without selection (no ``-k``/``-m``/node ids/``--lf``/
   ``--deselect``/``--ignore``); an entry for ``tests/`` is checked only when the
   collected ``tests/`` items run its backend (``tests/`` runs one backend per CI leg).
   The failure
   is a synthetic test ``parity/gaps.toml::stale_entries``;
4. an exception of a type not in ``raises`` is a failure, never hidden (the xfail has
   ``raises``; the report section names the expected and the actual type).

A malformed file (unknown keys, missing/empty ``reason``, missing/non-positive ``issue``,
a backend other than cpp/python, duplicate scenario+backend+where, an unknown exception
name) stops the run with a usage error.  ``--gaps-file PATH`` overrides the location.
"""

from __future__ import annotations

import builtins
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

BACKENDS = ("cpp", "python")
WHERES = ("parity", "tests")
KEYS_REQUIRED = ("scenario", "backend", "reason", "issue")
KEYS_OPTIONAL = ("raises", "where")
DEFAULT_RAISES = ("AssertionError",)
# kvcm errors are resolved lazily (importing kvcm selects a backend); these names are
# accepted without importing it, and resolved from kvcm.api / kvcm._select at collection.
KVCM_ERRORS = (
    "KvcmError",
    "ConfigError",
    "ClosedError",
    "InvalidStateError",
    "OutOfPagesError",
    "InvariantError",
    "BackendUnavailableError",
)
FIXED_HINT = "gap fixed → remove its entry from parity/gaps.toml"
STALE_ITEM = "stale_entries"


class GapFileError(ValueError):
    pass


@dataclass
class Gap:
    scenario: str
    backend: str
    reason: str
    issue: int
    raises: tuple[str, ...] = DEFAULT_RAISES
    where: str = "parity"
    index: int = 0  # position in the file (1-based), for messages
    matched: list[str] = field(default_factory=list)  # node ids

    @property
    def label(self) -> str:
        return f"gap #{self.issue}"

    def describe(self) -> str:
        return f"[[gap]] #{self.index}: scenario={self.scenario!r} backend={self.backend!r} where={self.where!r} issue={self.issue}"


def load_gaps(path: str | os.PathLike[str]) -> list[Gap]:
    """Parse and validate a gap file; a missing file means no gaps."""
    p = Path(path)
    if not p.exists():
        return []
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise GapFileError(f"{p}: not valid TOML: {e}") from None
    unknown_top = set(data) - {"gap"}
    if unknown_top:
        raise GapFileError(f"{p}: unknown top-level keys {sorted(unknown_top)}; only [[gap]] tables are allowed")
    entries = data.get("gap", [])
    if not isinstance(entries, list):
        raise GapFileError(f"{p}: 'gap' must be an array of tables ([[gap]])")
    gaps: list[Gap] = []
    seen: dict[tuple[str, str, str], int] = {}
    for i, e in enumerate(entries, 1):
        where = f"{p}: [[gap]] #{i}"
        if not isinstance(e, dict):
            raise GapFileError(f"{where}: must be a table")
        unknown = set(e) - set(KEYS_REQUIRED) - set(KEYS_OPTIONAL)
        if unknown:
            raise GapFileError(
                f"{where}: unknown keys {sorted(unknown)}; allowed: {list(KEYS_REQUIRED + KEYS_OPTIONAL)}"
            )
        for k in KEYS_REQUIRED:
            if k not in e:
                raise GapFileError(f"{where}: missing required key {k!r}")
        scenario, backend, reason, issue = e["scenario"], e["backend"], e["reason"], e["issue"]
        if not isinstance(scenario, str) or not scenario.strip() or scenario != scenario.strip():
            raise GapFileError(f"{where}: scenario must be a test function name, got {scenario!r}")
        if "[" in scenario:
            raise GapFileError(f"{where}: scenario {scenario!r} must be the function name without a [param] suffix")
        if backend not in BACKENDS:
            raise GapFileError(f"{where}: backend must be one of {list(BACKENDS)}, got {backend!r}")
        if not isinstance(reason, str) or not reason.strip():
            raise GapFileError(f"{where}: reason must be a non-empty string")
        if not isinstance(issue, int) or isinstance(issue, bool) or issue < 1:
            raise GapFileError(f"{where}: issue must be a positive issue number, got {issue!r}")
        raises = e.get("raises", list(DEFAULT_RAISES))
        if isinstance(raises, str):
            raises = [raises]
        if not isinstance(raises, list) or not raises or not all(isinstance(r, str) and r for r in raises):
            raise GapFileError(
                f"{where}: raises must be an exception name or a non-empty list of names, got {raises!r}"
            )
        for r in raises:
            _check_exception_name(r, where)
        loc = e.get("where", "parity")
        if loc not in WHERES:
            raise GapFileError(f"{where}: where must be one of {list(WHERES)}, got {loc!r}")
        key = (scenario, backend, loc)
        if key in seen:
            raise GapFileError(
                f"{where}: duplicate of entry #{seen[key]} (scenario={scenario!r}, backend={backend!r}, where={loc!r})"
            )
        seen[key] = i
        gaps.append(Gap(scenario, backend, reason.strip(), issue, tuple(raises), loc, i))
    return gaps


def _check_exception_name(name: str, where: str) -> None:
    if name in KVCM_ERRORS or name == "Failed" or "." in name:
        return
    obj = getattr(builtins, name, None)
    if not (isinstance(obj, type) and issubclass(obj, BaseException)):
        raise GapFileError(f"{where}: raises names an unknown exception type {name!r}")


def resolve_exception(name: str) -> type[BaseException]:
    if name == "Failed":
        return pytest.fail.Exception
    if name in KVCM_ERRORS:
        if name == "BackendUnavailableError":
            from kvcm._select import BackendUnavailableError

            return BackendUnavailableError
        import kvcm.api

        return getattr(kvcm.api, name)
    if "." in name:
        import importlib

        mod, _, attr = name.rpartition(".")
        obj = getattr(importlib.import_module(mod), attr)
        if not (isinstance(obj, type) and issubclass(obj, BaseException)):
            raise GapFileError(f"raises {name!r} is not an exception type")
        return obj
    return getattr(builtins, name)


# ---------------------------------------------------------------------------------------
# plugin state
# ---------------------------------------------------------------------------------------


@dataclass
class _State:
    path: Path
    gaps: list[Gap]
    by_item: dict[str, Gap] = field(default_factory=dict)  # nodeid -> gap
    stale: list[Gap] = field(default_factory=list)


_state_key = pytest.StashKey[_State]()


def get_state(config: pytest.Config) -> _State | None:
    return config.stash.get(_state_key, None)


def gap_for(item: pytest.Item) -> Gap | None:
    st = get_state(item.config)
    return st.by_item.get(item.nodeid) if st else None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--gaps-file", default=None, help="kvcm gap file (default: <rootdir>/parity/gaps.toml)")


def pytest_configure(config: pytest.Config) -> None:
    opt = config.getoption("--gaps-file")
    path = Path(opt) if opt else config.rootpath / "parity" / "gaps.toml"
    try:
        gaps = load_gaps(path)
    except GapFileError as e:
        raise pytest.UsageError(f"kvcm gaps: {e}") from None
    config.stash[_state_key] = _State(path=path, gaps=gaps)


def item_backend(item: pytest.Item) -> str | None:
    cs = getattr(item, "callspec", None)
    if cs is None:
        return None
    b = cs.params.get("backend")
    return b if isinstance(b, str) else None


def _item_where(item: pytest.Item, root: Path) -> str | None:
    try:
        rel = Path(item.path).resolve().relative_to(root.resolve())
    except ValueError:
        return None
    first = rel.parts[0] if rel.parts else ""
    return first if first in WHERES else None


def _selection_active(config: pytest.Config) -> bool:
    o = config.option
    return bool(
        getattr(o, "keyword", "")
        or getattr(o, "markexpr", "")
        or getattr(o, "lf", False)
        or getattr(o, "deselect", None)
        or getattr(o, "ignore", None)
        or getattr(o, "ignore_glob", None)
        or getattr(o, "sw", False)
    )


def _dir_fully_collected(config: pytest.Config, d: Path) -> bool:
    """True when the run's arguments include directory ``d`` (or a parent) as a whole."""
    if _selection_active(config):
        return False
    d = d.resolve()
    inv = Path(config.invocation_params.dir)
    for arg in config.args:
        if "::" in arg:
            continue
        p = (inv / arg).resolve()
        if p == d or p in d.parents:
            return True
    return False


def _resolved_raises(gap: Gap, cache: dict[str, type[BaseException]]) -> tuple[type[BaseException], ...]:
    out = []
    for name in gap.raises:
        if name not in cache:
            try:
                cache[name] = resolve_exception(name)
            except Exception as e:  # noqa: BLE001 - any failure to resolve is a usage error
                raise pytest.UsageError(f"kvcm gaps: {gap.describe()}: cannot resolve raises {name!r}: {e}") from None
        out.append(cache[name])
    return tuple(out)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    st = get_state(config)
    if st is None:
        return
    root = config.rootpath
    index: dict[tuple[str, str, str], Gap] = {(g.scenario, g.backend, g.where): g for g in st.gaps}
    exc_cache: dict[str, type[BaseException]] = {}
    seen_backends: dict[str, set[str]] = {w: set() for w in WHERES}
    for item in items:
        backend = item_backend(item)
        where = _item_where(item, root)
        if backend is None or where is None:
            continue
        seen_backends[where].add(backend)
        name = getattr(item, "originalname", None) or item.name.split("[")[0]
        gap = index.get((name, backend, where))
        if gap is None:
            continue
        gap.matched.append(item.nodeid)
        st.by_item[item.nodeid] = gap
        reason = f"{gap.label}: {gap.reason}"
        item.add_marker(pytest.mark.xfail(strict=True, raises=_resolved_raises(gap, exc_cache), reason=reason))

    # rule 3: entries that match nothing, where that is checkable
    stale = []
    for g in st.gaps:
        if g.matched or not _dir_fully_collected(config, root / g.where):
            continue
        # tests/ runs one backend per CI leg: an entry for another backend cannot match
        if g.where == "tests" and seen_backends["tests"] and g.backend not in seen_backends["tests"]:
            continue
        stale.append(g)
    st.stale = stale
    if stale:
        parent = _GapsFile.from_parent(session, path=st.path)
        items.append(_StaleGapsItem.from_parent(parent, name=STALE_ITEM))


class _GapsFile(pytest.File):
    def collect(self):  # pragma: no cover - never collected by path; built in modifyitems
        return []


class _StaleGapsItem(pytest.Item):
    def runtest(self) -> None:
        st = get_state(self.config)
        assert st is not None
        names = ", ".join(f"{g.scenario}[{g.backend}]" for g in st.stale)
        lines = [f"stale gap entries (match no collected test): {names}", f"in {_shown(st.path, self.config)}:"]
        for g in st.stale:
            lines.append(f"  {g.describe()}")
        lines.append("remove them (or fix the scenario name / backend / where)")
        raise _StaleGaps("\n".join(lines))

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, _StaleGaps):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"kvcm gaps: {STALE_ITEM}"


class _StaleGaps(Exception):
    pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]):
    outcome = yield
    gap = gap_for(item)
    if gap is None:
        return
    rep = outcome.get_result()
    if (
        rep.failed
        and call.when == "call"
        and call.excinfo is None
        and isinstance(rep.longrepr, str)
        and rep.longrepr.startswith("[XPASS(strict)]")
    ):
        rep.longrepr = (
            f"[XPASS(strict)] {FIXED_HINT}: {gap.describe()} passed"
            f" (the {gap.backend} backend now does what the scenario checks; issue #{gap.issue})"
        )
    elif rep.failed and call.excinfo is not None:
        rep.sections.append(
            (
                "kvcm gaps",
                (
                    f"{gap.describe()} expects {' | '.join(gap.raises)}, but {type(call.excinfo.value).__name__} was"
                    " raised — a gap never hides an unexpected exception"
                ),
            )
        )
    rep.user_properties.append(("kvcm_gap_issue", gap.issue))


def pytest_report_header(config: pytest.Config) -> str | None:
    st = get_state(config)
    if st is None:
        return None
    return f"kvcm gaps: {len(st.gaps)} entr{'y' if len(st.gaps) == 1 else 'ies'} from {_shown(st.path, config)}"


def _shown(path: Path, config: pytest.Config) -> str:
    try:
        return str(path.resolve().relative_to(config.rootpath.resolve()))
    except ValueError:
        return str(path)


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    st = get_state(config)
    if st is None or not st.stale:
        return
    terminalreporter.write_sep("=", "kvcm: stale gap entries", red=True)
    for g in st.stale:
        terminalreporter.write_line(f"{g.describe()} matches no collected test — remove it from {st.path.name}")
