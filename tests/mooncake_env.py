"""Fixtures that start a real Mooncake Store on 127.0.0.1 (``mooncake_master`` + one
``mooncake_client`` holding the memory; no metadata server: ``P2PHANDSHAKE``) and stop it,
and :func:`listening`: the ports a process listens on (the bind-address tests).

Without the mooncake package the tests that use them are skipped, except in CI
(``CI=true``), where a missing package fails them: CI must run them."""

from __future__ import annotations

import importlib.util
import ipaddress
import os

import pytest


def need_mooncake() -> None:
    if importlib.util.find_spec("mooncake") is None:
        msg = "the mooncake package is not installed (pip install 'kvcm[mooncake]')"
        if os.environ.get("CI") == "true":
            pytest.fail(msg + ": CI must run the Mooncake tests")
        pytest.skip(msg)


def listening(pid: int) -> set[tuple[str, int]]:
    """The TCP ports process ``pid`` listens on, as ``(address, port)`` (``/proc``: its
    socket inodes matched against ``/proc/<pid>/net/tcp{,6}``; IPv6 addresses compressed,
    e.g. ``"::"``)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    out = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                hexaddr, hexport = cols[1].split(":")
                raw = bytes.fromhex(hexaddr)
                # /proc prints the address as 32-bit words in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                out.add((str(ipaddress.ip_address(raw)), int(hexport, 16)))
    return out


def start(tmp_dir: str, segment_bytes: int = 256 << 20):
    need_mooncake()
    from kvcm.dataplane.mooncake_store import LocalMooncake

    return LocalMooncake(segment_bytes, log_dir=tmp_dir)


@pytest.fixture(scope="session")
def mooncake(tmp_path_factory: pytest.TempPathFactory):
    """One Mooncake Store for the session (tests use distinct object names)."""
    mc = start(str(tmp_path_factory.mktemp("mooncake")))
    try:
        yield mc
    finally:
        mc.stop()


@pytest.fixture
def fresh_mooncake(tmp_path):
    """A Mooncake Store of its own (for tests that kill its processes)."""
    mc = start(str(tmp_path))
    try:
        yield mc
    finally:
        mc.stop()
