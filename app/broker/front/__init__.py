"""A front end's side of broker mode (asyncio, no torch): the ``Transport`` the HTTP process
serves through (``transport``), its look at Redis every second (``monitor``), the requests it
waits the replies of (``waiting``), the backlog it reports to autoscalers (``backlog``), the
routes it keeps for scaling from zero (``routes``) and the workers it reports (``status``)."""
