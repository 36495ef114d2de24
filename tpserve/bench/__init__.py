"""Load tests that size a deployment: ``tpserve bench`` and a Locust user for distributed load.

- :mod:`tpserve.bench.cli`: the ``tpserve bench`` subcommand (flags, the run, its outputs).
- :mod:`tpserve.bench.datasets`: the workloads (random token-id prompts, a JSONL file).
- :mod:`tpserve.bench.arrivals`: Poisson/gamma arrival times and the concurrency cap.
- :mod:`tpserve.bench.runner`: one load against a live server over ``grpc.aio``.
- :mod:`tpserve.bench.metrics`: TTFT, TPOT, ITL, E2EL, throughputs and goodput (vLLM's definitions).
- :mod:`tpserve.bench.report`, :mod:`tpserve.bench.plot`: the summary table, the JSON file, the PNGs.
- :mod:`tpserve.bench.locustfile`: a Locust ``User`` that reports TTFT, TPOT and E2EL as request events.

Needs the ``bench`` extra (``pip install 'tpserve[bench]'``: tqdm, matplotlib, locust).
"""

from pathlib import Path

# For `locust -f`: the path of the Locust user file, found without importing it (which
# would import locust, and so gevent's monkey-patching, into the caller).
LOCUSTFILE = str(Path(__file__).with_name("locustfile.py"))
