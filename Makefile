# The two commands of the README. Each creates .venv and installs vgraph into it when needed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: demo test bench bench-gap bench-dynamic clean

# Each command installs only its own extra, so `make test` shows that the test extra alone runs the suite.
$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed-%: pyproject.toml | $(VENV)/bin/python
	$(BIN)/python -m pip install --quiet -e ".[$*]"
	touch $@

demo: $(VENV)/.installed-examples  ## the flagship: train an RNN by BPTT and render its unrolled graph
	$(BIN)/python examples/rnn_bptt.py

test: $(VENV)/.installed-test  ## the whole test suite
	$(BIN)/python -m pytest -q

bench: $(VENV)/.installed-examples,bench  ## the RNN training step against the tightest hand-written numpy BPTT and PyTorch eager
	$(BIN)/python tools/bench_rnn.py

bench-gap: $(VENV)/.installed-examples  ## the benchmark's gap to the floor, split: vgraph's operations vs its bookkeeping
	$(BIN)/python tools/bench_gap.py

bench-dynamic: $(VENV)/.installed-examples,bench  ## dynamic tasks (LSTM LM, BiLSTM tagger, Tree-LSTM, seq2seq with attention) against numpy floors and PyTorch eager
	$(BIN)/python tools/bench_dynamic.py
	$(BIN)/python tools/bench_seq2seq.py

clean:
	rm -rf $(VENV) build *.egg-info
