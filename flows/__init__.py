"""Prefect orchestration of the pipeline: tasks, the flow, artifacts and the CLI."""

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

# Import Prefect before anything imports Opacus: opacus.utils.module_utils calls
# logging.basicConfig() at import, which would otherwise take over the root logger.
import prefect.main  # noqa: E402,F401  (prefect.main configures logging)

# Progress lines (loss, ε, tokens/s) are INFO; they reach the console through the root
# logger's Prefect console handler and the UI through Prefect's API handler.
logging.getLogger("pipeline").setLevel(logging.INFO)
