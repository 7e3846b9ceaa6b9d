"""hetspot's orchestrator: CLI and API, the job controller, the cluster, state, preemption.

Rooms by concern (arrows point down this list, never back up; tests/test_layers.py checks it):
  errors.py, job_spec.py   the errors a user sees, and the job file
  control/    PURE (imports planner/ and errors only): the stepped controller and its protocols and fakes;
              failure.py (kinds, classification, the failure policy), drain.py (a notice becomes a drain),
              replan.py (where the re-plan and the scale-up are chosen), migration.py (bytes and pull
              times, also charged by the fleet simulator), capacity.py (the fleet's demand), snapshots.py
  state/      the tiered state plane (tiers.py), node keepers (keeper.py: bytes move keeper -> worker),
              the S3 format (s3_store.py), the pure restore planner (restore_plan.py)
  cluster/    discovery from Ray and EC2, node sources, the profiling pass, the autoscaler executor, the
              embedded test cluster
  preemption/ notice sources: IMDS, GCP, Azure, Ray's drain; the fake metadata server
  runtime/    Ray executors of control/'s decisions: the controller actor, the worker group (where a lost
              node is detected), metrics, progress lines, the Ray Jobs client
  drills/, deploy/   recovery drills and the fleet simulator; deploy config renderers
  api.py, driver.py  what the CLI calls; the Ray Jobs entry point
  cli/        the typer CLI (main.py) and its tables
"""
