"""What a run shows people: the HTML report and the model cards."""

# What the flow records in stages.json (flows/pipeline_flow.py StageRunner) as people read it,
# in the report and in `dpdistill status` alike (issue 24: one said "finished", the other "ran").
STAGE_WORDS = {"ran": "finished", "forced": "finished (forced rerun)", "cached": "cached", "failed": "failed",
               "running": "running"}
