# `make demo` and `make test` each work from a fresh clone: they build .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all lint bench clean venv deploy-configs gpu-check

# An editable install compiles nothing: the last step compiles hetspot's modules as a wheel install would (a shell
# that sets PYTHONDONTWRITEBYTECODE=1 otherwise compiles them again on every command, about 0.4 s of `hetspot plan`).
$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	$(BIN)/python -m compileall -q planner workers orchestrator
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/hetspot plan examples/mixed-cluster.yaml
	$(BIN)/hetspot submit examples/tiny-mixed.yaml
	rm -rf hetspot-demo && $(BIN)/python examples/make_tokenizer.py hetspot-demo/tokenizer.json README.md docs/*.md
	$(BIN)/hetspot data prepare README.md docs/*.md --tokenizer hetspot-demo/tokenizer.json --out hetspot-demo/shards --shard-mib 0.1
	$(BIN)/hetspot submit examples/tiny-shards.yaml
	$(BIN)/hetspot drill drills/preempt.yaml --plot drill-preempt.png

# Two xdist workers: one runs the embedded-cluster test modules one after another, the other the modules with Ray
# heads of their own and then the pure modules, longest first (tests/conftest.py); then, alone, what owns the
# machine's Ray (marker `exclusive`: `ray stop`, Ray's default ports), collected from the modules that use the marker
# only (collecting all of them takes about 7 s).
EXCLUSIVE := $(shell grep -l 'mark\.exclusive' tests/test_*.py)
test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25 -n 2 --dist loadfile --no-loadscope-reorder -m 'not slow and not gpu and not exclusive'
	$(BIN)/python -m pytest -q --durations=10 -m 'exclusive and not slow and not gpu' $(EXCLUSIVE)

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m ''

lint: $(STAMP)
	$(BIN)/ruff check planner workers orchestrator tests bench

gpu-check: $(STAMP)  # the GPU checklist (docs/gpu.md): gpu tests, offload bench, MFU, profiling; needs CUDA
	$(BIN)/python bench/gpu_check.py --json docs/gpu-run.json
	$(BIN)/python bench/report.py --gpu docs/gpu-run.json

# Every CPU benchmark at a size for a 2-core machine (about 35 minutes), its tables written into docs/benchmarks.md
# (bench/report.py); bench/peers.py needs Ray Train and torchft, the `peers` extra.
bench: $(STAMP)
	$(BIN)/pip install --quiet -c constraints.txt -e '.[peers]'
	$(BIN)/python bench/report.py

deploy-configs: $(STAMP)  # re-render deploy/ from orchestrator/deploy/render.py (a test checks they match)
	$(BIN)/hetspot deploy render --cloud aws --out deploy/aws/mixed-spot.yaml
	$(BIN)/hetspot deploy render --cloud kuberay --mix h100:1,a100:2,l4:4,t4:4 --platform gke --rayjob --out deploy/kuberay/gke-spot.yaml
	$(BIN)/hetspot deploy render --cloud kuberay --mix a100:2,a10g:2,l4:4,t4:4 --platform eks --out deploy/kuberay/eks-spot.yaml
	$(BIN)/hetspot deploy render --cloud kuberay --mix a100:2,a10g:2,l4:4,t4:4 --platform eks-karpenter --rayjob --out deploy/kuberay/eks-karpenter-spot.yaml

clean:
	rm -rf $(VENV) build *.egg-info
