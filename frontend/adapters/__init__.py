"""The frontend's side of adapters: which are loaded, the operations that change that, and their files.

registry.py    AdapterRegistry: name -> adapter id/path/pin, in-flight holds, drain on unload, host-memory LRU
manager.py     AdapterManager: load, unload, in-place reload, eviction and reload, resolver; deadlines, rollback
state_file.py  AdapterStateFile: --lora-state-file, atomic rewrite, restore
files.py       a start-up adapter's config; a directory as tensor frames (node 0); torch tensors as specs and frames
"""
