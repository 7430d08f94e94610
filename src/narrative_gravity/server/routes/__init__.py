"""The server's routes, one ``APIRouter`` module per group."""
