"""Worker processes: launching them into slots and supervising them."""
