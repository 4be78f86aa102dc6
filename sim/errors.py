"""Errors that mean "the user's input is wrong": printed without a traceback, exit code 2."""


class UserError(Exception):
    """A problem with the user's input; printed without a traceback, exit code 2."""
