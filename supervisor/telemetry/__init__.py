"""What the pool tells its operators: told what happened, it decides nothing on the path."""
