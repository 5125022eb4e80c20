"""Stage job entry points, `python -m stages.<name> --run-dir R --iteration K`: one per stage kind
(hpcrl.stage_kinds), each a few lines over hpcrl.stage.job_main."""
