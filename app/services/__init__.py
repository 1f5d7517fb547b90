"""Services: prediction on top of the Streamer (the routers call these)."""
