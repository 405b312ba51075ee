"""Spans of an attempt and their delivery to the Store as OTLP."""
