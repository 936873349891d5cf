"""SGLang's side of the engine seam.

``features`` (which release has what), ``recipe`` (server arguments, the logprobs SGLang returns, ``verify_engine``).
No module here imports SGLang at module level.
"""
