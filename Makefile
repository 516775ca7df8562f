# hvdtrain: every command the README gives is a target here.
#   make install   .venv with the pinned stack and a Horovod built for it (cached wheel after the first build)
#   make demo      install, then train Fashion-MNIST on 2 Horovod workers (installed with apt as root; where it cannot
#                  be, the embedded digits instead, said in one line)
#   make test      install, then run the test suite (the strict docs build included)
#   make docs      install, then build the documentation site into site/ (strict: a broken link fails)
# FRAMEWORKS (default "torch mxnet") chooses what is installed and what Horovod is built for; GPU hosts choose the
# framework builds with TORCH_SPEC / TORCH_INDEX / MXNET_SPEC and one framework per environment (docs/gpu.md),
#   e.g. make install FRAMEWORKS=torch VENV=.venv-gpu TORCH_INDEX=https://<your torch wheel index>/cu128 HOROVOD_GPU_OPERATIONS=NCCL

PYTHON      ?= python3.11
COMMA       := ,
VENV        ?= .venv
PY          := $(VENV)/bin/python
CONSTRAINTS := scripts/constraints.txt
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
MXNET_SPEC  ?= mxnet==1.9.1
GLUONCV_SPEC ?= gluoncv==0.10.5.post0
FRAMEWORKS  ?= torch mxnet
NP          ?= 2
DATA        ?= data/digits
FASHION     := /usr/share/datasets/fashion-mnist
DEMO_EPOCHS ?= 6
# numpy stays at 1.23.x wherever MXNet is installed (mxnet 1.9.1 breaks on numpy >= 1.24). pip writes no bytecode
# here; COMPILE writes it for everything installed, on every core, after the install (Horovod's wheel gets it from
# pip, at its install). Where PYTHONDONTWRITEBYTECODE is set (as on the machines this was built on), Python would
# otherwise compile every module it imports, in every process: 4.5 s of CPU to import torch instead of 1.3, and 5.7 s
# instead of 1.2 for torch._dynamo, which a PyTorch optimizer's first step imports (measured here). Its errors are
# ignored: torch ships test files for newer Pythons.
PIP_INSTALL := $(PY) -m pip install --disable-pip-version-check --no-compile -q \
	$(if $(filter mxnet,$(FRAMEWORKS)),-c $(CONSTRAINTS))

ifdef HOROVOD_GPU_OPERATIONS
export HOROVOD_GPU_OPERATIONS
endif
export HVDTRAIN_FRAMEWORKS := $(FRAMEWORKS)
FRAMEWORK_SPECS := $(if $(filter torch,$(FRAMEWORKS)),"$(TORCH_SPEC)") \
	$(if $(filter mxnet,$(FRAMEWORKS)),"$(MXNET_SPEC)" "$(GLUONCV_SPEC)")

.PHONY: docs install deps horovod demo demo-mxnet demo-digits data-fashion imagenet-synthetic imagenet-fashion bench bench-network bench-decode \
	convergence test test-stacks test-unit data doctor clean

install: deps horovod

deps: $(VENV)/.deps-stamp

# The installed packages are kept once per set of requirements (scripts/venv_cache.sh): a fresh clone's install links
# them in (seconds) instead of installing and compiling them again (about 100 s here); DEPS_KEY names that set.
DEPS_ARGS := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) $(FRAMEWORK_SPECS) \
	"cmake>=3.13,<4" wheel "setuptools>=61" -e ".[data,vision,test,docs,track,remote,ray$(if $(filter torch,$(FRAMEWORKS)),$(COMMA)onnx)]"
DEPS_KEY = $$({ "$(PYTHON)" -VV; uname -m; echo '$(PIP_INSTALL) $(DEPS_ARGS)'; cat setup.cfg $(CONSTRAINTS) \
	scripts/venv_cache.sh; "$(PYTHON)" -m pip config list 2>/dev/null; env | grep '^PIP_' | sort; } | sha256sum | cut -c1-32)

$(VENV)/.deps-stamp: setup.cfg $(CONSTRAINTS) Makefile scripts/venv_cache.sh
	@bash scripts/check_stack.sh "$(PYTHON)" "$(FRAMEWORKS)"
	@set -e; key=$(DEPS_KEY); \
	if bash scripts/venv_cache.sh restore "$(PYTHON)" "$(VENV)" "$$key"; then \
		$(PIP_INSTALL) --no-deps --no-build-isolation -e .; \
	else \
		test -x $(PY) || $(PYTHON) -m venv $(VENV); \
		echo '$(PIP_INSTALL) $(DEPS_ARGS)'; $(PIP_INSTALL) $(DEPS_ARGS); \
		$(COMPILE) "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" || true; \
		bash scripts/venv_cache.sh save "$(VENV)" "$$key" || true; \
	fi; \
	$(COMPILE) hvdtrain recipes tests scripts || true
	@touch $@

COMPILE = $(PY) -W ignore -m compileall -qq -j 0

horovod: deps
	bash scripts/build_horovod.sh $(PY)

$(DATA)/train-images-idx3-ubyte: | deps
	$(PY) scripts/make_digits_mnist.py $(DATA)

data: $(DATA)/train-images-idx3-ubyte

data-fashion:
	bash scripts/install_fashion_mnist.sh

# Fashion-MNIST, $(DEMO_EPOCHS) epochs on $(NP) workers (about 4 minutes on 2 cores; the recipe's full 15-epoch run is
# `python -m hvdtrain recipe fashion-mnist`); the embedded digits where Fashion-MNIST cannot be installed.
demo: install
	@if bash scripts/install_fashion_mnist.sh; then \
		$(VENV)/bin/horovodrun -np $(NP) -H localhost:$(NP) --gloo $(PY) -m hvdtrain recipe fashion-mnist \
			--framework torch --epochs $(DEMO_EPOCHS) --output-dir runs/demo-torch --resume never; \
	else \
		echo "demo: Fashion-MNIST is not available here (above: why); training on the embedded digits instead"; \
		$(MAKE) --no-print-directory demo-digits; \
	fi

demo-mxnet: install data-fashion
	$(VENV)/bin/horovodrun -np $(NP) -H localhost:$(NP) --gloo $(PY) -m hvdtrain recipe fashion-mnist --framework mxnet \
		--epochs $(DEMO_EPOCHS) --output-dir runs/demo-mxnet --resume never

demo-digits: install data
	$(VENV)/bin/horovodrun -np $(NP) -H localhost:$(NP) --gloo $(PY) -m hvdtrain recipe mnist --framework torch \
		--data-dir $(DATA) --output-dir runs/demo-digits --resume never

# ResNet-50 on random tensors, 2 workers, a few steps per framework: the training step's img/s on this machine.
imagenet-synthetic: install
	@for fw in torch mxnet; do \
		$(VENV)/bin/horovodrun -np $(NP) -H localhost:$(NP) --gloo $(PY) -m hvdtrain recipe imagenet --framework $$fw \
			--synthetic --epochs 1 --warmup-epochs 0 --max-steps 10 --batch-size 16 --image-size 112 \
			--output-dir runs/imagenet-synthetic-$$fw --resume never | grep -E "img/s|hvdtrain:" || exit 1; \
	done

# The ImageNet recipe on real images: Fashion-MNIST written as an ImageFolder of 32 px PNGs and packed as RecordIO,
# then ResNet-18 with the large-batch recipe (warmup, cosine decay, label smoothing, mixup, no weight decay on biases
# and BatchNorm, --precision auto: bf16 where the CPU has it natively, else fp32) on $(NP) workers: PyTorch reads the
# ImageFolder, MXNet the RecordIO (FASHION_FRAMEWORK=mxnet).
# FASHION_EPOCHS and FASHION_PER_CLASS (training images per class, 0: all) size it; docs/convergence.md has the result.
FASHION_EPOCHS    ?= 10
FASHION_PER_CLASS ?= 0
FASHION_FRAMEWORK ?= torch
FASHION_IMAGES    := runs/fashion-images
$(FASHION_IMAGES)/train.rec: | install
	bash scripts/install_fashion_mnist.sh
	$(PY) scripts/idx_to_imagefolder.py $(FASHION) $(FASHION_IMAGES) --names fashion --size 32 \
		--train-per-class $(FASHION_PER_CLASS)
	$(PY) scripts/make_recordio.py $(FASHION_IMAGES) $(FASHION_IMAGES)
imagenet-fashion: install $(FASHION_IMAGES)/train.rec
	$(VENV)/bin/horovodrun -np $(NP) -H localhost:$(NP) --gloo $(PY) -m hvdtrain recipe imagenet \
		--framework $(FASHION_FRAMEWORK) --data-dir $(FASHION_IMAGES) \
		--data-format $(if $(filter mxnet,$(FASHION_FRAMEWORK)),recordio,imagefolder) \
		--model resnet18_v1b --image-size 32 --val-resize 32 --min-crop-area 0.5 \
		--batch-size 64 --lr-per-256 0.4 --warmup-epochs 2 --epochs $(FASHION_EPOCHS) --lr-mode cosine --last-gamma \
		--label-smoothing 0.1 --mixup 0.2 --mixup-off-epoch 2 --no-wd --precision auto --num-workers 1 --resume never \
		--output-dir runs/imagenet-fashion-$(FASHION_FRAMEWORK)

# Test accuracy of the fashion-mnist recipe at np=1, np=2 and with accumulation, both frameworks (about an hour on 2
# cores): docs/convergence.md.
convergence: install data-fashion
	$(PY) -m hvdtrain bench convergence

# Side-by-side benchmarks (about 22 minutes on 2 cores), in runs/bench/: the MNIST recipe on synthetic data -- scaling
# sweep (np = 1..NP) and hvdtrain against a bare Horovod loop on both frameworks, Horovod against DDP --, allreduce
# bandwidth and fusion settings, Horovod against MXNet's parameter server, and the ImageNet input pipelines
# (ImageFolder on PyTorch, RecordIO on MXNet) on a generated photo folder with ResNet-18 at 64 px.
# docs/benchmarks.md explains the figures.
BENCH_STEPS ?= 200
BENCH_PHOTOS := runs/bench/photos
BENCH_INPUT := --image-size 64 --model resnet18_v1b --batch-size 8 --data-dir $(BENCH_PHOTOS)
$(BENCH_PHOTOS)/train.rec: | install
	$(PY) scripts/make_photo_folder.py $(BENCH_PHOTOS) --tile 80 --train-per-class 256 --val-per-class 16
	$(PY) scripts/make_recordio.py $(BENCH_PHOTOS) $(BENCH_PHOTOS)

bench: install $(BENCH_PHOTOS)/train.rec
	$(PY) -m hvdtrain bench scaling --recipe mnist --framework torch --max-np $(NP) --output-dir runs/bench/mnist-torch
	$(PY) -m hvdtrain bench scaling --recipe mnist --framework mxnet --max-np $(NP) --output-dir runs/bench/mnist-mxnet
	$(PY) -m hvdtrain bench overhead --recipe mnist --framework torch --max-np $(NP) --steps $(BENCH_STEPS) --output-dir runs/bench/mnist-torch
	$(PY) -m hvdtrain bench overhead --recipe mnist --framework mxnet --max-np $(NP) --steps $(BENCH_STEPS) --output-dir runs/bench/mnist-mxnet
	$(PY) -m hvdtrain bench ddp --recipe mnist --np $(NP) --steps $(BENCH_STEPS) --same-cores --candidates \
		--output-dir runs/bench/mnist-torch
	$(PY) -m hvdtrain bench ps --recipe mnist --np $(NP) --steps $(BENCH_STEPS) --output-dir runs/bench/mnist-mxnet
	$(PY) -m hvdtrain bench allreduce --np $(NP) --output-dir runs/bench/allreduce
	$(PY) -m hvdtrain bench input --recipe imagenet --framework torch --output-dir runs/bench/input-torch -- \
		$(BENCH_INPUT) --data-format imagefolder --num-workers 1
	$(PY) -m hvdtrain bench input --recipe imagenet --framework mxnet --output-dir runs/bench/input-mxnet -- \
		$(BENCH_INPUT) --data-format recordio
	$(MAKE) --no-print-directory bench-decode

# Decoded and augmented images per second per core at 224 px, for each input path of the ImageNet recipe, on 1,000
# ImageNet-like JPEGs (about 476x419 px, 106 KB) and their RecordIO (about 3 minutes): runs/bench/decode/,
# docs/bench/input.md.
DECODE_PHOTOS := runs/bench/imagenet-like
$(DECODE_PHOTOS)/train.rec: | install
	$(PY) scripts/make_photo_folder.py $(DECODE_PHOTOS) --imagenet-like --train-per-class 500 --val-per-class 25
	$(PY) scripts/make_recordio.py $(DECODE_PHOTOS) $(DECODE_PHOTOS)
bench-decode: install $(DECODE_PHOTOS)/train.rec
	$(PY) -m hvdtrain bench decode --data-dir $(DECODE_PHOTOS) --output-dir runs/bench/decode

# Horovod's loop, hvdtrain (plain and --shard-optimizer) and MXNet's parameter server (1 server, a server per host)
# over rate-limited links between 2, 3 and 4 namespace hosts with a CPU quota each (root): runs/bench/network/
# network.json and network.png; docs/bench/network.md.
bench-network: install
	$(PY) -m hvdtrain bench network --output-dir runs/bench/network

# The real-data tests want Fashion-MNIST: installed where possible, skipped with the reason where not.
docs: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# Three pytest workers: the suite's jobs wait on start-ups, timeouts and each other, so one worker left about half of
# a 2-core machine idle, two left 15% of it (171% CPU, pytest 970 s here) and three leave 11% (178%, 830 s). Files
# run whole in one worker, the machine-wide ones one after another in one (tests/conftest.py).
TEST_WORKERS ?= 3
test: install
	-@bash scripts/install_fashion_mnist.sh
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

# Each supported Python beside 3.11 in its own venv, 1 epoch of MNIST on 2 ranks each (a Horovod build per Python:
# about 5 minutes each here, and PyTorch's CUDA wheel past 3.11); runs/stacks/matrix.md. Not part of make test.
test-stacks:
	bash scripts/test_stacks.sh $(STACKS)

test-unit: install
	$(PY) -m pytest -q tests/unit

doctor: install
	$(PY) -m hvdtrain doctor

clean:
	rm -rf runs build *.egg-info
