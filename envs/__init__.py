"""agentrl.envs"""
