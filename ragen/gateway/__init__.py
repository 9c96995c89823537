"""An OpenAI-compatible gateway on the shared engine, one session per episode, recording exact tokens.

- ``calls``: a client's request read and checked (chat completions, completions);
- ``segments``: each call's prompt ids, appended to the session's ids where it extends
  the previous call, a new segment (and why) where it does not;
- ``session``: sessions, their keys, bounds and expiry; ``record``: what each call keeps;
- ``link``: calls through the ``SharedLLMInferenceManager``; ``gateway``: a call played
  (the rollout's sampling, the context's room, the drift audit); ``replies``: OpenAI's shapes;
- ``streaming``: a streamed answer's ids shown as text as the engine samples them;
- ``server``: the HTTP server, a base URL per session; ``recording``: each session's calls
  written as JSON lines when it closes (``python -m ragen.tools.gateway --record``).
"""
