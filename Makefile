# The two commands of the README. Each creates .venv and installs vgraph into it when needed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test bench bench-gap bench-dynamic clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test,examples]"
	touch $(STAMP)

demo: $(STAMP)  ## the flagship: train an RNN by BPTT and render its unrolled graph
	$(BIN)/python examples/rnn_bptt.py

test: $(STAMP)  ## the whole test suite
	$(BIN)/python -m pytest -q

bench: $(STAMP)  ## the performance benchmark against the tightest hand-written numpy BPTT
	$(BIN)/python tools/bench_rnn.py

bench-gap: $(STAMP)  ## the benchmark's gap to the floor, split: vgraph's operations vs its bookkeeping
	$(BIN)/python tools/bench_gap.py

bench-dynamic: $(STAMP)  ## dynamic tasks (LSTM language model, BiLSTM tagger): words/s, phases, memory
	$(BIN)/python tools/bench_dynamic.py

clean:
	rm -rf $(VENV) build *.egg-info
