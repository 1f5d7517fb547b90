"""Services: image decoding/preprocessing and prediction on top of the Streamer."""
