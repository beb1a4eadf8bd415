"""Internals of the scheduler (server/scheduler.py): stage pools, sessions, groups, records."""
