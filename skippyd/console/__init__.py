"""The web console's side of the daemon: what its pages show, gathered from the head and the stages.

``pipeline``  every stage's health and load, each link's round trip (:class:`PipelineMonitor`)
``views``     the running sessions and the lanes, as the pages show them
``history``   tok/s, time to first token and queue length over the last 15 minutes
``feed``      one snapshot of all of it, republished when it changes, at a bounded rate
``static``    the page itself (HTML, CSS, JS), shipped in the package

The HTTP routes that serve these are in :mod:`skippyd.openai.console`.
"""
