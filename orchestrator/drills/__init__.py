"""Recovery drills: scenarios, fault injection on the test cluster, spot-trace replay, fleet simulation.

Pure parts (no Ray, no boto3): `scenario` (drill files), `trace` (Parcae spot traces),
`fleet` (goodput simulation over the planner and cost model). `runner` injects the
faults on the embedded Ray cluster and moto's S3 server; `report` renders results.
"""
