"""The benchmarks, their workloads and their measuring sticks: tooling, not runtime (issue 36).
One module per command of ``python -m kvcm bench`` (:mod:`kvcm.cli.bench` parses and
dispatches):

* ``bench keys`` and ``bench replay``: in :mod:`kvcm.cli.bench`, the replay measured against
  :mod:`~kvcm.bench.floor` (``MinimalPrefixCache``, the python backend's measuring stick);
* ``bench probe|decode|step|ssm|evict|memory``: :mod:`~kvcm.bench.micro`;
* ``bench vllm``: :mod:`~kvcm.bench.vllm` (real vLLM engines with and without kvcm), its plan
  (:mod:`~kvcm.bench.vllm_plan`), its figures (:mod:`~kvcm.bench.vllm_report`), ``--model
  gemma3`` (:mod:`~kvcm.bench.vllm_hybrid`), and one engine process running a workload
  (:mod:`~kvcm.bench.vllm_workload`, ``python -m kvcm.bench.vllm_workload SPEC OUT``; the
  connector's engine tests drive it too);
* ``bench disagg``: :mod:`~kvcm.bench.disagg` (prefill and decode servers through kvcm);
* ``bench transformers``: :mod:`~kvcm.bench.transformers` (transformers' continuous batching
  with and without kvcm).
* ``events --bench``: :mod:`~kvcm.bench.events` (the KV-event publisher's cost per engine
  step; its command is ``events``).

Layering (pyproject.toml, import-linter): the benchmarks sit below the command line and above
the tools and the integrations they drive; no runtime package imports them.  Importing this
package imports none of its modules (the engine benchmarks need ``kvcm[vllm]`` or
``kvcm[transformers]``).
"""
