"""The Ray node labels hetspot reads (discovery) and the deploy configs and test clusters set. One place, so a
config and the code that reads it cannot spell a key two ways."""

LABEL_GPU_TYPE = "hetspot/gpu-type"  # the catalog's GPU type of the node's GPUs
LABEL_MARKET = "hetspot/market"  # spot or on-demand
LABEL_NODE = "hetspot/node"  # the node's name in plans (on EC2: its instance id)
LABEL_INSTANCE_ID = "hetspot/instance-id"
LABEL_INSTANCE_TYPE = "hetspot/instance-type"
LABEL_FAKE_GPU = "hetspot/fake-gpu"  # "true" on nodes whose GPUs are pretend (test and embedded clusters)
