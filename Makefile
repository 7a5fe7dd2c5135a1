# Every target sets itself up: a fresh clone needs nothing but python3 and make (on Windows:
# GNU make run from Git Bash, as .github/workflows/ci.yml does, with PYTHON=python).
PYTHON ?= python3
VENV ?= .venv
ifeq ($(OS),Windows_NT)
# The recipes are bash (process substitution): Git Bash's, found on PATH; a Windows venv keeps
# its programs in Scripts/, as .exe files.
SHELL := bash
BIN := $(VENV)/Scripts
EXE := .exe
else
SHELL := /bin/bash
BIN := $(VENV)/bin
EXE :=
endif
PY := $(BIN)/python$(EXE)
BASE := $(VENV)/.installed-base
FULL := $(VENV)/.installed-full
DEMO := $(VENV)/.installed-demo
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
# Every install after torch's own runs under this constraint: a requirement that wants another
# torch fails the install instead of replacing the CPU build with a CUDA one.
TORCH_PIN := torch==2.13.0
KEEP_TORCH := -c <(echo $(TORCH_PIN))
# The loader matrix's transformers 4 cells: transformers 4 and 5 cannot share a venv.
TF4_VENV ?= .venv-tf4
TF4 := $(TF4_VENV)/.installed-tf4
TF4_PIP := $(TF4_VENV)/bin/python -m pip install --quiet --disable-pip-version-check

.PHONY: install test test-fast test-portable lint demo docs bench fuzz clean fs-tools

$(PY):
	$(PYTHON) -m venv $(VENV)

$(BASE): pyproject.toml | $(PY)
	$(PIP) -e . 2> >(grep -v "^WARNING: Location" >&2)
	touch $@

# torch first, pinned: it is the CPU build on these machines; a bare `torch` requirement
# from another package would pull the CUDA build instead.
$(FULL): pyproject.toml | $(PY)
	$(PIP) $(TORCH_PIN) 2> >(grep -v "^WARNING: Location" >&2)
	DS_BUILD_OPS=0 $(PIP) $(KEEP_TORCH) -e '.[test,dev,remote,ray]' 2> >(grep -v "^WARNING: Location" >&2)
	touch $@ $(BASE) $(DEMO)

# A second venv for tests/loader_tf4.py: the same pinned CPU torch, transformers 4 (the `tf4`
# extra). The cells that need it are skipped, saying so, when it is absent.
$(TF4_VENV)/bin/python:
	$(PYTHON) -m venv $(TF4_VENV)

$(TF4): pyproject.toml | $(TF4_VENV)/bin/python
	$(TF4_PIP) $(TORCH_PIN) 2> >(grep -v "^WARNING: Location" >&2)
	$(TF4_PIP) $(KEEP_TORCH) -e '.[tf4]' 2> >(grep -v "^WARNING: Location" >&2)
	touch $@

# The demo also saves a sample with torch.save, so it gets torch (pinned, CPU) but not the
# test dependencies.
$(DEMO): $(BASE)
	$(PIP) $(TORCH_PIN) 2> >(grep -v "^WARNING: Location" >&2)
	touch $@

install: $(FULL)

# The zero-copy tests and the reflink benchmark loop-mount XFS and btrfs images: their mkfs
# tools, installed with apt-get where they are missing and that can (root, apt present). This
# never fails: without them the tests skip and say why.
FS_TOOLS := xfsprogs btrfs-progs
fs-tools:
	@export PATH="$$PATH:/usr/sbin:/sbin"; \
	if command -v mkfs.xfs >/dev/null && command -v mkfs.btrfs >/dev/null; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
		echo "note: $(FS_TOOLS) missing and not installable here; the zero-copy tests will skip"; \
		exit 0; \
	fi; \
	export DEBIAN_FRONTEND=noninteractive; \
	apt-get install -y -q $(FS_TOOLS) >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null 2>&1 && apt-get install -y -q $(FS_TOOLS) >/dev/null 2>&1; } || \
		echo "note: could not install $(FS_TOOLS); the zero-copy tests will skip"

# Two workers, one per core of the 2-core CI machines: run serially with its setup, the suite
# no longer fits in CI's 30 minutes (the Megatron, DeepSpeed and GGUF fixtures alone take
# minutes of one core).
# Then the fast suite once more on ckptfix's portable primitives (test-portable).
test: $(FULL) $(TF4) fs-tools
	$(PY) -m pytest -q -n 2 --dist loadgroup
	$(MAKE) --no-print-directory test-portable

# The inner loop: everything but the tests marked slow (signals, interop, huge files, property,
# anything over about 0.15 s of CPU but one of each family, the pairs of a corpus and a command
# it samples: pyproject.toml says which), the fuzz targets with 100 examples each instead of
# 300; about 46 s of CPU in all, some 20 s on each of 2 cores. `make test` runs them all. Byte code is written even where
# PYTHONDONTWRITEBYTECODE is set: without it every run, and every CLI process a test starts,
# compiles ckptfix and rewrites the tests' asserts again (it cost 25 s of CPU of 164).
test-fast: $(FULL)
	PYTHONDONTWRITEBYTECODE= CKPTFIX_FUZZ_EXAMPLES=100 $(PY) -m pytest -q -m "not slow" -n 2 --dist loadgroup

# The fast suite on the portable primitives (ckptfix.platform.portable: reads at offsets without
# pread, no O_NOFOLLOW or dir_fd, no renameat2, buffered copies, a lock file), which Windows and
# other systems build on and which only run here so (tests/conftest.py, --platform).
test-portable: $(FULL)
	PYTHONDONTWRITEBYTECODE= CKPTFIX_FUZZ_EXAMPLES=100 $(PY) -m pytest -q -m "not slow" -n 2 --dist loadgroup --platform portable

lint: $(FULL)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	@if [ -e "$(BIN)/actionlint$(EXE)" ]; then $(BIN)/actionlint .github/workflows/ci.yml; \
	else echo "note: actionlint is not installed here (the dev extra has it on Linux x86-64): .github/workflows/ci.yml not checked"; fi

demo: $(DEMO)
	@$(PY) scripts/make_demo.py demo-out
	@echo; echo "\$$ ckptfix inspect demo-out/sample-model"
	@$(BIN)/ckptfix inspect demo-out/sample-model; echo "(exit code $$?: this sample has errors on purpose)"
	@echo; echo "\$$ ckptfix convert demo-out/sample-model/pytorch_model.bin -o demo-out/never"
	@$(BIN)/ckptfix convert demo-out/sample-model/pytorch_model.bin -o demo-out/never; \
		echo "(exit code $$?: refused, nothing written: $$(test -e demo-out/never && echo WRONG || echo demo-out/never does not exist))"
	@echo; echo "\$$ ckptfix fix demo-out/sample-model -o demo-out/repaired-model"
	@rm -rf demo-out/repaired-model
	@$(BIN)/ckptfix fix demo-out/sample-model -o demo-out/repaired-model; echo "(exit code $$?)"
	@echo; echo "\$$ ckptfix inspect demo-out/fixable-model --fail-on warning"
	@$(BIN)/ckptfix inspect demo-out/fixable-model --fail-on warning; echo "(exit code $$?)"
	@echo; echo "\$$ ckptfix reshard demo-out/fixable-model -o demo-out/fixed-model --max-shard 100KB"
	@$(BIN)/ckptfix reshard demo-out/fixable-model -o demo-out/fixed-model --max-shard 100KB
	@echo; echo "\$$ ckptfix inspect demo-out/fixed-model --fail-on warning"
	@$(BIN)/ckptfix inspect demo-out/fixed-model --fail-on warning
	@echo; echo "\$$ ckptfix inspect demo-out/torch-model"
	@$(BIN)/ckptfix inspect demo-out/torch-model; echo "(exit code $$?)"
	@echo; echo "\$$ ckptfix convert demo-out/torch-model -o demo-out/converted-model"
	@$(BIN)/ckptfix convert demo-out/torch-model -o demo-out/converted-model
	@echo; echo "\$$ ckptfix inspect demo-out/converted-model --fail-on warning"
	@$(BIN)/ckptfix inspect demo-out/converted-model --fail-on warning
	@echo; echo "\$$ ckptfix hash demo-out/converted-model"
	@$(BIN)/ckptfix hash demo-out/converted-model
	@echo; echo "\$$ ckptfix diff demo-out/torch-model demo-out/converted-model"
	@$(BIN)/ckptfix diff demo-out/torch-model demo-out/converted-model; echo "(exit code $$?)"

# docs/cli.md, rendered from the Typer app: every command's usage, arguments and options
# (tests/test_docs_links.py fails when it is stale).
docs: $(BASE)
	$(PY) -m ckptfix.cli.reference docs/cli.md

bench: $(FULL) fs-tools
	$(PY) bench/bench.py

fuzz: $(FULL)
	CKPTFIX_FUZZ_EXAMPLES=5000 $(PY) -m pytest -q tests/test_fuzz.py tests/test_mutation_property.py

clean:
	rm -rf $(VENV) $(TF4_VENV) demo-out .pytest_cache .mypy_cache .ruff_cache .hypothesis
