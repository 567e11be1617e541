"""Tools run from a checkout (not part of the installed product; nothing under loraplex imports them).

    launch_server.py  python -m scripts.launch_server [flags]: the server, in SGLang's command form
    bench/            benchmarks: python -m scripts.bench NAME (the ratio benchmarks) or python -m scripts.bench.NAME
    gpu_check/        the one GPU check: python -m scripts.gpu_check --plan | --dry-run | --out DIR (GPU_CHECK.md)
    sim/              the cluster simulator: python -m scripts.sim.simulate, python -m scripts.sim.calibrate
    demo/             the built-in demo model: python -m scripts.demo.train, python -m scripts.demo.screenshots

A new tool is a sub-package of its own (image/, say, for the container image build, with a __main__.py) or a module
in the one it belongs to (bench/roofline.py). The tiny models and adapters that the tests and these tools build live
in tests/builders.py: the test suite never imports scripts/ except in the tests of these tools.
"""
