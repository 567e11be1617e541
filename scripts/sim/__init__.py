"""The cluster simulator: N replicas, each the real torch-free Scheduler, behind a routing policy.

    cluster.py    the simulator core (replicas, step-cost model, simulate)
    policies.py   the routers
    simulate.py   python -m scripts.sim.simulate: sweeps replicas and policies, table and plot
    calibrate.py  python -m scripts.sim.calibrate: measures the step-cost model on this machine
"""
