"""The collective save and load engine: inventory, planning, staging, and the
save/load pipelines every entry point runs on.
"""
