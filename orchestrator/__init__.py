"""hetspot's orchestrator: CLI and API, the job controller, the cluster, state, preemption.

Layout (one-way arrows: a module imports only from rows above it or from planner/ and workers/):
  errors, job_spec, protocols, policies, preemption/failures, progress_lines  -- pure: no Ray, no boto3
  fakes, state/snapshots                                                        -- pure fakes and stores
  cluster/ (discovery, ec2, node_sources, profiling, embedded), worker_group, metrics
  controller (state machine over the protocols), controller_actor (its Ray actor), driver (Ray Jobs entry)
  ray_jobs (Ray Jobs / State API client), api (what the CLI calls), render, cli
"""
