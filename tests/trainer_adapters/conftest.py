from tests.trainer_adapters.venvs import gym_venv, verl_venv

__all__ = ["gym_venv", "verl_venv"]
