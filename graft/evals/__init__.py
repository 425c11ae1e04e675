"""Quality evaluations of a running engine through its OpenAI API (`graft eval ...`).

They need no torch: a Job of the quality gate runs them against the canary and stable Services.
"""
