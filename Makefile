# Two commands for a fresh machine:
#   make app    install, then start the explorer on http://localhost:8501
#   make test   install (with test tools), then run the whole suite, browser test included
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PORT ?= 8501

.PHONY: app test install install-dev bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

install: $(BIN)/python
	$(BIN)/pip install -q -r requirements.txt

install-dev: $(BIN)/python
	$(BIN)/pip install -q -r requirements-dev.txt

app: install
	$(BIN)/streamlit run app.py --server.port $(PORT) --server.address localhost --browser.gatherUsageStats false

# Two workers (each test file on one, in order), then the tests marked serial alone: their figures need a quiet machine.
test: install-dev
	$(BIN)/python -m pytest -n 2 --dist loadfile -m "not serial"
	$(BIN)/python -m pytest -m serial

bench: install
	$(BIN)/python bench/comm_bandwidth.py

clean:
	rm -rf $(VENV) .pytest_cache
