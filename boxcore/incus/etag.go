package incus

import (
	"errors"
	"net/http"
)

// IsPreconditionFailed reports whether err is Incus's answer to a write whose If-Match ETag
// no longer matches the object (412): someone changed it after the caller read it.
func IsPreconditionFailed(err error) bool {
	var se *StatusError
	return errors.As(err, &se) && se.Code == http.StatusPreconditionFailed
}
