# Developer shortcuts. The package builds with plain `pip install .`; these are conveniences.
PY ?= python

.PHONY: build build-cpu test clean demo info

build:            ## in-place build (CUDA when nvcc is found)
	$(PY) setup.py build_ext --inplace

build-cpu:        ## in-place CPU-only build
	NCP_NO_CUDA=1 $(PY) setup.py build_ext --inplace

test:
	$(PY) -m pytest -q

demo:
	$(PY) -m nemo_cp_native demo

info:
	$(PY) -m nemo_cp_native info

clean:
	rm -rf build nemo_cp_native/_C*.so
