"""The cluster: discovery from Ray (and EC2), node sources for the controller, profiling, the embedded test cluster."""
