"""No database models yet: the request path never touches the database."""
