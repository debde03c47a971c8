"""A former import path: :mod:`usp_hal._moved` says where its code lives now."""
from usp_hal._moved import redirect

redirect(__name__)
