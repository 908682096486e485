"""The public API documents itself (issue 21): every public class, function, method and
property reachable from ``kvcm.__all__`` has a docstring (an inherited one counts, as
``inspect.getdoc`` finds it), every field of a public dataclass is named in its class's
``Attributes:`` section (for ``KVCacheManagerConfig`` with its default and SPEC section),
and ``help()`` on a backend's manager and cache shows the interface's contract."""

from __future__ import annotations

import dataclasses
import inspect
import pydoc
import re

import kvcm
from kvcm import api


def _public_classes() -> list[type]:
    return [obj for name in kvcm.__all__ if inspect.isclass(obj := getattr(kvcm, name))]


def _members(cls: type) -> list[tuple[str, object]]:
    """The public methods and properties of ``cls`` that kvcm defines (its own or a kvcm
    base's; what Exception, Enum and object define is theirs to document)."""
    out = []
    for name in dir(cls):
        if name.startswith("_"):
            continue
        owner = next(k for k in cls.__mro__ if name in k.__dict__)
        if not owner.__module__.startswith("kvcm"):
            continue
        raw = inspect.getattr_static(cls, name)
        if isinstance(raw, property):
            out.append((name, raw))
        elif isinstance(raw, (staticmethod, classmethod)) or inspect.isfunction(raw):
            out.append((name, getattr(cls, name)))
    return out


def _own_class_doc(cls: type) -> str:
    """The class's own docstring; a dataclass's generated signature does not count."""
    doc = cls.__dict__.get("__doc__") or ""
    return "" if doc.startswith(f"{cls.__name__}(") else doc.strip()


def attributes_section(doc: str) -> dict[str, str]:
    """``{name: text}`` of the ``Attributes:`` section of a (cleaned) docstring: entries
    ``    name: text`` with continuation lines indented deeper."""
    entries: dict[str, str] = {}
    lines = doc.splitlines()
    try:
        start = lines.index("Attributes:")
    except ValueError:
        return entries
    name = None
    for line in lines[start + 1:]:
        if line and not line.startswith(" "):
            break
        m = re.match(r"^    (\w+): (.*)$", line)
        if m:
            name = m[1]
            entries[name] = m[2]
        elif name is not None and line.startswith("        "):
            entries[name] += " " + line.strip()
    return entries


def test_the_public_names_are_found():
    classes = {c.__name__ for c in _public_classes()}
    assert {"KVCacheManager", "KVCache", "KVCacheManagerConfig", "CopyOp", "StoredEvent"} <= classes
    members = {n for n, _ in _members(kvcm.KVCacheManager)}
    assert {"drain_copy_ops", "forget_copies", "resize_batch", "commit_batch", "config"} <= members


def test_every_public_class_has_its_own_docstring():
    missing = [c.__name__ for c in _public_classes() if not _own_class_doc(c)]
    assert not missing, f"classes without a docstring: {missing}"


def test_every_public_function_method_and_property_has_a_docstring():
    missing = [name for name in kvcm.__all__
               if inspect.isfunction(getattr(kvcm, name)) and not inspect.getdoc(getattr(kvcm, name))]
    for cls in _public_classes():
        missing += [f"{cls.__name__}.{n}" for n, member in _members(cls) if not inspect.getdoc(member)]
    assert not missing, f"public API without a docstring: {missing}"


def test_every_field_of_a_public_dataclass_is_documented():
    missing = []
    for cls in _public_classes():
        if not dataclasses.is_dataclass(cls):
            continue
        for f in dataclasses.fields(cls):
            # a field is documented by the class that declares it (Event.event_id by Event)
            owner = next(k for k in cls.__mro__ if f.name in inspect.get_annotations(k))
            documented = attributes_section(inspect.cleandoc(_own_class_doc(owner)))
            if not documented.get(f.name):
                missing.append(f"{cls.__name__}.{f.name}")
    assert not missing, f"dataclass fields missing from their class's Attributes: section: {missing}"


def test_every_config_field_names_its_default_and_spec_section():
    documented = attributes_section(inspect.cleandoc(_own_class_doc(kvcm.KVCacheManagerConfig)))
    bad = []
    for f in dataclasses.fields(kvcm.KVCacheManagerConfig):
        text = documented.get(f.name, "")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required:
            if not re.search(r"\bRequired\b", text):
                bad.append(f"{f.name}: does not say Required")
        else:
            # "Default 10_000", "Default True", "Default ``\"commit\"``"
            shown = f'``"{f.default}"``' if isinstance(f.default, str) else str(f.default)
            said = re.search(r"\bDefault (\S+)", text)
            if said is None or said[1].rstrip(".").replace("_", "") != shown.replace("_", ""):
                bad.append(f"{f.name}: the documented default is not {shown}")
        if not re.search(r"SPEC sec\. \d+", text):
            bad.append(f"{f.name}: names no SPEC section")
    assert not bad, "\n".join(bad)


def test_the_attributes_parser_reads_entries_and_continuations():
    doc = "Title.\n\nAttributes:\n    a: one\n        more\n    b: two\nAfter."
    assert attributes_section(doc) == {"a": "one more", "b": "two"}


def test_help_on_either_backend_shows_the_contract(make_manager):
    config = kvcm.KVCacheManagerConfig(tokens_per_block=4, layers=[kvcm.AttentionLayer(0, 8)],
                                       tiers=[kvcm.Tier("gpu", 4096)])
    mgr = make_manager(config)
    cache = mgr.create_kv_cache([1, 2, 3])
    bad = []
    for obj, interface in ((mgr, api.KVCacheManager), (cache, api.KVCache)):
        cls = type(obj)
        if not (inspect.getdoc(cls) or "").startswith(inspect.getdoc(interface)):
            bad.append(f"{cls.__name__}: class docstring")
        for name, contract in _members(interface):
            doc = inspect.getdoc(inspect.getattr_static(cls, name) if isinstance(contract, property)
                                 else getattr(cls, name)) or ""
            if not doc.startswith(inspect.getdoc(contract)):
                bad.append(f"{cls.__name__}.{name}")
        text = pydoc.render_doc(obj, renderer=pydoc.plaintext)
        first = inspect.getdoc(interface).splitlines()[0]
        if first not in text:
            bad.append(f"help({cls.__name__}) does not show {first!r}")
    assert "Take the pending copy ops" in pydoc.render_doc(mgr, renderer=pydoc.plaintext)
    assert not bad, f"help() hides the interface's contract: {bad}"
