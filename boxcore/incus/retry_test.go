package incus

import (
	"context"
	"fmt"
	"testing"
)

func TestRetryBridgeChildrenRace(t *testing.T) {
	race := &StatusError{Code: 500, Message: "Failed to delete bridge children interfaces: x", Method: "PUT", Path: "/1.0/networks/n"}
	other := &StatusError{Code: 500, Message: "something else"}
	if !IsBridgeChildrenRace(fmt.Errorf("wrapped: %w", race)) || IsBridgeChildrenRace(other) || IsBridgeChildrenRace(nil) {
		t.Fatal("IsBridgeChildrenRace misclassifies")
	}
	for _, m := range []string{"POST", "DELETE"} {
		e := &StatusError{Code: 500, Message: "Failed to delete bridge children interfaces: x", Method: m, Path: "/1.0/networks"}
		if !IsBridgeChildrenRace(e) {
			t.Fatalf("the race on a network %s is not recognised", m)
		}
	}
	n := 0
	err := RetryBridgeChildrenRace(context.Background(), func() error {
		if n++; n < 3 {
			return race
		}
		return nil
	})
	if err != nil || n != 3 {
		t.Fatalf("race twice then success: err %v after %d tries", err, n)
	}
	n = 0
	if err := RetryBridgeChildrenRace(context.Background(), func() error { n++; return other }); err != other || n != 1 {
		t.Fatalf("another error must not be retried: %v after %d tries", err, n)
	}
}
