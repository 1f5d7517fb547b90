"""Worker processes: the only place that imports torch to run models."""
