"""Prefect orchestration of the pipeline: tasks, the flow, artifacts and the CLI.

Importing this package sets Prefect's environment only; it imports no Prefect, so that the
CLI's light commands (`--help`, `status`, `ledger show`, `report`) stay fast (issue 10).
Every flows module that imports Prefect and the pipeline imports `prefect.main` first.
"""

import logging
import os

# Route the library's stdlib loggers (`pipeline.*`) into Prefect's run logs (the UI);
# this must be set before Prefect configures logging on import.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "pipeline")
# The embedded server would try to send telemetry; these machines are offline and the
# failed attempt is logged as an error on every run.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# Library code also runs outside flows (build-base, benchmarks, torchrun ranks): its log
# lines then stay on the console without a warning that no flow run is there to take them.
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
# Without PREFECT_API_URL each run starts a temporary local Prefect server, which Prefect
# gives 20 s to answer; on a loaded machine (importing torch alongside) that is too short
# and the first run dies with "Timed out while attempting to connect to ephemeral Prefect
# API server" (issue 10). A user's own value wins.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

# Import Prefect before anything imports Opacus: opacus.utils.module_utils calls
# logging.basicConfig() at import, which would otherwise take over the root logger. The
# modules that import both (flows/pipeline_flow.py, caching.py, ...) import prefect.main,
# which configures logging, first; this package itself does not, see above.

# Progress lines (loss, ε, tokens/s) are INFO; they reach the console through the root
# logger's Prefect console handler and the UI through Prefect's API handler.
logging.getLogger("pipeline").setLevel(logging.INFO)

# Prefect builds a JSON schema of each task's parameters; the generation plan's runtime
# default (a torch.device) has none, and pydantic warns about it at every run.
import warnings  # noqa: E402

warnings.filterwarnings("ignore", message=r"Default value .* is not JSON serializable")
