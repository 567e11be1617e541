"""The built-in demo model (`--model-path demo`, shipped in frontend/demo_assets/).

    train.py        python -m scripts.demo.train [--check]: trains it on tests/demo_tasks.py's tasks, writes the assets
    screenshots.py  python -m scripts.demo.screenshots: the web console's screenshots for the docs
"""
