package ctxtime

import (
	"context"
	"testing"
	"time"
)

func TestSleep(t *testing.T) {
	if !Sleep(context.Background(), time.Millisecond) {
		t.Error("a sleep that ran out reported false")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	start := time.Now()
	if Sleep(ctx, time.Hour) {
		t.Error("a cancelled sleep reported true")
	}
	if time.Since(start) > time.Second {
		t.Error("a cancelled sleep waited")
	}
}
